"""The profile store: a folder of calibration profiles (JSON) with their plots (PNG, same stem).

Location, decided once where a command or the server starts (`ProfileStore.locate`):
1. an explicit folder (`--store DIR`);
2. else the environment variable BASTION_PROFILE_STORE (read once, by `locate`, nowhere else);
3. else DEFAULT_STORE under the user's home: ~/.cache/bastion-sglang/profiles.

File names (`profile_file_name`) are for people; lookups read the metadata inside each file:
<device>--<model>--<dtype>--<attention backend>--tp<N>--<engine>--<first 12 of config hash>--<UTC time>.json,
every part lower-cased with runs of other characters than [a-z0-9.] turned into "-". Files whose name starts
with "." (e.g. the temporary files of an atomic save) are not profiles.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.controller.profile import THOROUGHNESS, CalibrationProfile, ProfileError, load_profile

logger = logging.getLogger(__name__)

STORE_ENV = "BASTION_PROFILE_STORE"
"""Environment variable naming the store folder when no --store is given."""
DEFAULT_STORE = Path(".cache") / "bastion-sglang" / "profiles"
"""The store folder relative to the user's home directory when neither --store nor STORE_ENV is set."""
PROFILE_SUFFIX = ".json"
PLOT_SUFFIX = ".png"


def _slug(text: str) -> str:
    """Lower case, runs of characters outside [a-z0-9.] -> '-', no leading/trailing '-'."""
    slug = re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")
    return slug or "unnamed"


def profile_file_name(profile: CalibrationProfile) -> str:
    """The store's file name for `profile` (module docstring)."""
    meta = profile.metadata
    model = Path(meta.model_path.rstrip("/\\")).name or meta.model_path
    parts = (
        _slug(meta.device_name),
        _slug(model),
        _slug(meta.dtype),
        _slug(meta.attention_backend),
        f"tp{meta.tp_size}",
        meta.engine,
        meta.model_config_hash[:12],
        meta.created_at.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ"),
    )
    return "--".join(parts) + PROFILE_SUFFIX


def plot_path_for(profile_path: Path) -> Path:
    """Where the plot of the profile at `profile_path` lives: the same stem with .png."""
    return profile_path.with_suffix(PLOT_SUFFIX)


@dataclass(frozen=True)
class StoreEntry:
    """One profile file of the store: its contents, or why they cannot be read (exactly one is set)."""

    path: Path
    profile: CalibrationProfile | None
    error: ProfileError | None


@dataclass(frozen=True)
class ProfileMatch:
    """A stored profile that matches a runtime identity."""

    path: Path
    profile: CalibrationProfile


@dataclass(frozen=True)
class Rejected:
    """A readable stored profile that does not match: what it differs in (identity.Mismatch triples)."""

    path: Path
    mismatches: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class ProfileSearch:
    """What `ProfileStore.find_profile` found.

    match: the latency profile to plan with (None: none matches). matches: every match, preferred first
    (`preference`). acceptance: the preferred match whose acceptance part is this runtime's drafter's
    (None: none is). acceptance_misses: for each other match, why its acceptance part is not.
    rejected: readable profiles that do not match, and why. skipped: unreadable files.
    """

    match: ProfileMatch | None
    matches: tuple[ProfileMatch, ...]
    acceptance: ProfileMatch | None
    acceptance_misses: tuple[tuple[Path, str], ...]
    rejected: tuple[Rejected, ...]
    skipped: tuple[StoreEntry, ...]


def preference(match: ProfileMatch) -> tuple[int, datetime, str]:
    """Sort key of matches, larger first preferred: the most thorough (`THOROUGHNESS`: bastion calibrate,
    then a full start-up, then a quick one), then the newest, then the file name."""
    meta = match.profile.metadata
    return THOROUGHNESS[meta.made_by], meta.created_at, match.path.name


@dataclass(frozen=True)
class ProfileStore:
    """A folder of calibration profiles. `root` need not exist yet (an empty store)."""

    root: Path

    @classmethod
    def locate(cls, explicit: str | Path | None, environ: Mapping[str, str] = os.environ) -> ProfileStore:
        """The store to use: `explicit`, else $BASTION_PROFILE_STORE, else ~/.cache/bastion-sglang/profiles.

        Reads `environ` once; call this once where a command or the server starts and pass the store on.
        """
        if explicit is not None:
            root, why = Path(explicit), "--store"
        elif environ.get(STORE_ENV):
            root, why = Path(environ[STORE_ENV]), f"${STORE_ENV}"
        else:
            root, why = Path.home() / DEFAULT_STORE, "the default location"
        store = cls(root.expanduser())
        logger.debug("profile store: %s (from %s)", store.root, why)
        return store

    def path_for(self, profile: CalibrationProfile) -> Path:
        """Where `profile` is saved in this store."""
        return self.root / profile_file_name(profile)

    def list_profiles(self) -> list[StoreEntry]:
        """Every profile file of the store, sorted by name, each loaded or with its ProfileError."""
        if not self.root.exists():
            return []
        if not self.root.is_dir():
            raise ProfileError(self.root, "the profile store is not a folder")
        entries = []
        for path in sorted(self.root.glob(f"*{PROFILE_SUFFIX}")):
            if path.name.startswith(".") or not path.is_file():
                continue
            try:
                entries.append(StoreEntry(path, load_profile(path), None))
            except ProfileError as error:
                entries.append(StoreEntry(path, None, error))
        return entries

    def find_profile(self, identity: RuntimeIdentity) -> ProfileSearch:
        """The profiles whose metadata matches `identity`'s latency part (`RuntimeIdentity.mismatches`),
        preferred first (`preference`), and the preferred one whose acceptance part is this drafter's
        (`RuntimeIdentity.acceptance_mismatch`).

        A file that cannot be read (unreadable, corrupt, wrong version) is skipped and listed in
        `ProfileSearch.skipped`, so one broken file in a shared store does not stop servers of other
        devices or models; but when its name says it was measured for `identity` (`named_for`), its
        ProfileError is raised: the profile meant for this runtime is broken, and planning without it
        would hide that.
        """
        matches, rejected, skipped = [], [], []
        for entry in self.list_profiles():
            if entry.error is not None:
                if named_for(entry.path, identity):
                    raise entry.error
                skipped.append(entry)
            elif entry.profile is not None:
                mismatches = identity.mismatches(entry.profile)
                if mismatches:
                    rejected.append(Rejected(entry.path, tuple(mismatches)))
                else:
                    matches.append(ProfileMatch(entry.path, entry.profile))
        matches.sort(key=preference, reverse=True)
        misses = [(match.path, identity.acceptance_mismatch(match.profile)) for match in matches]
        acceptance = next(
            (match for match, (_, miss) in zip(matches, misses, strict=True) if miss is None), None
        )
        return ProfileSearch(
            match=matches[0] if matches else None,
            matches=tuple(matches),
            acceptance=acceptance,
            acceptance_misses=tuple((path, miss) for path, miss in misses if miss is not None),
            rejected=tuple(rejected),
            skipped=tuple(skipped),
        )


def named_for(path: Path, identity: RuntimeIdentity) -> bool:
    """Whether a store file's name (`profile_file_name`) names `identity`'s device, dtype, attention backend,
    tp size, engine (when the identity has one) and model config hash."""
    parts = path.name.removesuffix(PROFILE_SUFFIX).split("--")
    if len(parts) != 8:
        return False
    device, _, dtype, backend, tp, engine, config_hash, _ = parts
    return (
        device == _slug(identity.device_name)
        and dtype == _slug(identity.dtype)
        and backend == _slug(identity.attention_backend)
        and tp == f"tp{identity.tp_size}"
        and (identity.engine is None or engine == identity.engine)
        and config_hash == identity.model_config_hash[:12]
    )
