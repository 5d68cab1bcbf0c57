"""The model card (README.md) of a trained drafter: YAML metadata validated by pydantic, then prose.

The metadata block holds the Hugging Face card keys and, under `bastion_training`, every figure the prose
quotes (data, steps, wall time, losses, held-out acceptance), so the numbers are machine-readable and
come from the run's own state, never typed by hand. A DFlash2 drafter's card (a selector trained on a
frozen DFlash backbone, `training.selector`) also holds the backbone's own chain acceptance on the same
held-out blocks.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.training.selector import SelectorTrainConfig, SelectorTrainingState
from bastion_sglang.training.train import AcceptanceReport, InitialDrafter, TrainConfig, TrainingState

CARD_NAME = "README.md"


class DataSummary(BaseModel):
    """What the drafter was trained and measured on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = Field(description="target model the data was regenerated with")
    prompt_sets: list[str]
    train_sequences: int
    train_response_tokens: int
    heldout_sequences: int
    max_new_tokens: int
    generation_dtype: str
    generation_seconds: float = Field(description="wall time of the regeneration, train + held-out")
    token_data: str | None = Field(
        default=None,
        description="committed token-data folder the training sequences came from (`training.token_data`); "
        "None: regenerated with captured features",
    )
    validation_sequences: int = Field(
        default=0, ge=0, description="training-split sequences kept out of training to choose settings on"
    )


class TrainingSummary(BaseModel):
    """The `bastion_training` metadata block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: DataSummary
    config: TrainConfig | SelectorTrainConfig
    initialised_from: InitialDrafter | None = Field(
        default=None, description="set when the run continued a trained drafter; figures count this run only"
    )
    steps_done: int
    train_seconds: float
    device: str
    final_loss: float | None
    acceptance: AcceptanceReport | None = Field(description="held-out chain acceptance at steps_done")
    validation: AcceptanceReport | None = Field(
        default=None, description="chain acceptance on the validation sequences at steps_done"
    )
    backbone_acceptance: AcceptanceReport | None = Field(
        default=None, description="DFlash2: the frozen backbone's DFlash chain on the same held-out blocks"
    )


class CardMetadata(BaseModel):
    """The YAML front matter of README.md."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    license: str
    base_model: str
    tags: list[str]
    library_name: str
    bastion_training: TrainingSummary


def write_card(
    folder: Path,
    *,
    name: str,
    license_id: str,
    base_model: str,
    drafter: DrafterConfig,
    state: TrainingState | SelectorTrainingState,
    data: DataSummary,
    device: str,
    acceptance: AcceptanceReport | None,
    mask_token: str,
    backbone_acceptance: AcceptanceReport | None = None,
    validation: AcceptanceReport | None = None,
) -> Path:
    """Write folder/README.md for a drafter at `state.step`; returns its path. backbone_acceptance: a DFlash2
    drafter's frozen backbone measured on the same blocks; validation: the chain on the validation
    sequences (`DataSummary.validation_sequences`)."""
    summary = TrainingSummary(
        data=data,
        config=state.config,
        initialised_from=state.initialised_from,
        steps_done=state.step,
        train_seconds=state.seconds,
        device=device,
        final_loss=state.history[-1].loss if state.history else None,
        acceptance=acceptance,
        backbone_acceptance=backbone_acceptance,
        validation=validation,
    )
    family = ["dflash"] if drafter.selector is None else ["dflash2", "dflash"]
    metadata = CardMetadata(
        license=license_id,
        base_model=base_model,
        tags=[*family, "speculative-decoding", "bastion", "block-diffusion"],
        library_name="sglang",
        bastion_training=summary,
    )
    front = yaml.safe_dump(metadata.model_dump(mode="json"), sort_keys=False, width=100)
    path = folder / CARD_NAME
    prose = _prose if drafter.selector is None else _selector_prose
    path.write_text(f"---\n{front}---\n\n{prose(name, base_model, drafter, summary, mask_token)}", "utf-8")
    return path


def read_card_metadata(path: Path) -> CardMetadata:
    """Parse the front matter of a card written by `write_card`; ValueError naming the file if it is bad."""
    text = path.read_text(encoding="utf-8")
    parts = text.split("---\n", 2)
    if len(parts) < 3 or parts[0]:
        raise ValueError(f"{path}: no YAML front matter between '---' lines")
    try:
        return CardMetadata.model_validate(yaml.safe_load(parts[1]))
    except (yaml.YAMLError, ValidationError) as error:
        raise ValueError(f"{path}: bad card metadata: {error}") from None


def describe_initial_drafter(folder: Path) -> InitialDrafter:
    """What `folder`'s card says of its training, earlier runs included (None where it has no card).

    ValueError naming the card if it is malformed.
    """
    card = folder / CARD_NAME
    if not card.is_file():
        return InitialDrafter(name=folder.name, steps_done=None, train_seconds=None, generation_dtype=None)
    summary = read_card_metadata(card).bastion_training
    steps, seconds = summary.steps_done, summary.train_seconds
    earlier = summary.initialised_from
    if earlier is not None and earlier.steps_done is not None and earlier.train_seconds is not None:
        steps, seconds = steps + earlier.steps_done, seconds + earlier.train_seconds
    return InitialDrafter(
        name=folder.name,
        steps_done=steps,
        train_seconds=seconds,
        generation_dtype=summary.data.generation_dtype,
    )


def _initialisation(config: TrainConfig, initial: InitialDrafter | None) -> str:
    if initial is not None:
        history = (
            f" ({initial.steps_done} steps, {initial.train_seconds / 3600:.2f} h, on data regenerated in "
            f"{initial.generation_dtype})"
            if initial.steps_done is not None and initial.train_seconds is not None
            else ""
        )
        return (
            f"Initialised from the trained drafter `{initial.name}`{history}; the figures above count "
            "this run only."
        )
    if config.init_from_target:
        return "Initialised from the target layers that follow the last feature layer."
    return "Initialised at random."


def _token_data_note(data: DataSummary) -> str:
    """The sentence naming the committed token data and the validation sequences, if any."""
    if data.token_data is None:
        return ""
    return (
        f" The training sequences are the committed token ids of `{data.token_data}` (the target's "
        f"features computed from them during training); {data.validation_sequences} of them were kept out "
        "of training to choose settings on."
    )


def _prose(
    name: str, base_model: str, drafter: DrafterConfig, summary: TrainingSummary, mask_token: str
) -> str:
    config, data = summary.config, summary.data
    hours = summary.train_seconds / 3600
    lines = [
        f"# {name}",
        "",
        f"A DFlash block-diffusion drafter for `{base_model}`, for `--speculative-algorithm BASTION` (and",
        "SGLang's built-in DFLASH). Given the target's features of the committed tokens, it proposes",
        f"distributions for the next {drafter.block_size - 1} tokens in one forward pass. It has no",
        "embedding and no LM head: the target's are shared. Output stays exactly the target's; the",
        "drafter only changes speed.",
        "",
        "## Architecture",
        "",
        f"- {drafter.num_hidden_layers} draft layers, hidden {drafter.hidden_size}, "
        f"{drafter.num_attention_heads} heads / {drafter.num_key_value_heads} KV heads of "
        f"{drafter.head_dim}, MLP {drafter.intermediate_size}, RoPE θ {drafter.rope_theta:g}.",
        f"- Context features: target layers {list(drafter.target_layer_ids)} (0-based outputs, "
        f"`hidden_states[l + 1]`) of {drafter.num_target_layers}, concatenated, `fc` + `hidden_norm`.",
        f"- Block size {drafter.block_size}; mask token id {drafter.mask_token_id} (`{mask_token}`).",
        "- z-lab checkpoint format (`config.json` with `dflash_config`, `model.safetensors`), loaded",
        "  unchanged by SGLang 0.5.23's `DFlashDraftModel` and by `bastion_sglang.reference.drafter`.",
        "",
        "## Training data",
        "",
        f"Prompts from {', '.join(data.prompt_sets)} (training split of `bastion_sglang.assets.prompt_sets`;",
        f"the held-out split is never trained on). The target answered each prompt greedily "
        f"({data.generation_dtype}, up to {data.max_new_tokens} new tokens): {data.train_sequences} "
        f"sequences, {data.train_response_tokens} response tokens; {data.heldout_sequences} held-out "
        f"sequences for measurement. Regeneration took {data.generation_seconds / 3600:.2f} h."
        + _token_data_note(data),
        "",
        "## Training",
        "",
        f"{summary.steps_done} of {config.steps} steps on {summary.device} ({hours:.2f} h of training),",
        f"{config.batch_sequences} sequences × {config.anchors_per_sequence} random anchors per step"
        + (" (every prompt set drawn as often)," if config.set_mix == "equal" else ","),
        f"per-position loss weights exp(-(k-1)/{config.loss_decay:g})"
        + (" (position k sampled with that probability)" if config.sample_positions else "")
        + (
            f", each position's loss {1 - config.distill:g} × the target token's cross-entropy + "
            f"{config.distill:g} × the cross-entropy to the target's next-token distribution"
            if config.distill > 0
            else ""
        )
        + f", AdamW lr {config.lr:g} "
        f"(warmup {config.warmup_steps} steps, cosine to 0), weight decay {config.weight_decay:g}, "
        f"{config.precision}, seed {config.seed}."
        + (f" Last logged loss: {summary.final_loss:.3f} nats." if summary.final_loss is not None else ""),
        _initialisation(config, summary.initialised_from),
        "",
        "## Held-out acceptance",
        "",
    ]
    report = summary.acceptance
    if report is None:
        lines.append("Not measured yet.")
    else:
        lines += [
            "Chain acceptance against the target's greedy continuation of held-out prompts: for each",
            "anchor, 1 + the number of leading block positions whose drafter argmax equals the target's",
            f"token (at most {drafter.block_size}); {report.blocks} blocks.",
            "",
            "| set | mean accepted length |",
            "|---|---|",
            *(f"| {source} | {mean:.2f} |" for source, mean in report.by_source.items()),
            f"| all | {report.mean:.2f} |",
        ]
    if summary.validation is not None:
        lines += [
            "",
            f"On the {data.validation_sequences} validation sequences ({summary.validation.blocks} blocks): "
            f"{summary.validation.mean:.2f}.",
        ]
    lines += [
        "",
        "## Use",
        "",
        "```",
        "python -m sglang.launch_server --model-path $(bastion demo setup --print-path) \\",
        f"    --speculative-algorithm BASTION --speculative-draft-model-path models/{name}",
        "```",
        "",
    ]
    return "\n".join(lines)


def _backbone_history(initial: InitialDrafter | None) -> str:
    if initial is None or initial.steps_done is None or initial.train_seconds is None:
        return "The backbone's own training is not recorded."
    return (
        f"The backbone `{initial.name}` trained {initial.steps_done} steps "
        f"({initial.train_seconds / 3600:.2f} h) on data regenerated in {initial.generation_dtype}; the "
        "figures above count the selector's run only."
    )


def _selector_prose(
    name: str, base_model: str, drafter: DrafterConfig, summary: TrainingSummary, mask_token: str
) -> str:
    config, data, selector = summary.config, summary.data, drafter.selector
    if not isinstance(config, SelectorTrainConfig) or selector is None:
        raise ValueError("a DFlash2 card needs a selector run's config and a drafter with a selector")
    backbone = Path(config.init_from_drafter).name
    lines = [
        f"# {name}",
        "",
        f"A DFlash2 drafter for `{base_model}`: the DFlash block-diffusion drafter `{backbone}`, frozen,",
        "with a candidate selector trained on top. In one forward pass it proposes the top "
        f"{selector.top_k} candidates",
        f"of each of the next {drafter.block_size - 1} tokens and scores every transition between the",
        "candidates of adjacent positions; BASTION's reference engine builds its best-first trees over that",
        "lattice. It has no embedding and no LM head: the target's are shared. Output stays exactly the",
        "target's; the drafter only changes speed.",
        "",
        "## Architecture",
        "",
        f"- Backbone: {drafter.num_hidden_layers} draft layers, hidden {drafter.hidden_size}, "
        f"{drafter.num_attention_heads} heads / {drafter.num_key_value_heads} KV heads of "
        f"{drafter.head_dim}, MLP {drafter.intermediate_size}, RoPE θ {drafter.rope_theta:g}; context "
        f"features of target layers {list(drafter.target_layer_ids)} of {drafter.num_target_layers}; block "
        f"size {drafter.block_size}, mask token id {drafter.mask_token_id} (`{mask_token}`).",
        f"- Selector: rank {selector.rank}, {selector.top_k} candidates per position from the target's LM "
        "head; codebooks [vocab, rank] (`candidate_selector.predecessor_codebook`, `successor_codebook`) and "
        "a projection [rank, hidden] of the drafter's state; no output multiplier, no softcap.",
        f"- `{selector.architecture}` in the published DFlash2 format (`config.json` with the selector's "
        "keys in `dflash_config`, bf16 `model.safetensors`): SGLang 0.5.23's `DFlash2DraftModel` loads its "
        "weights unchanged, as does `bastion_sglang.reference.drafter`.",
        "",
        "## Training data",
        "",
        f"Prompts from {', '.join(data.prompt_sets)} (training split of `bastion_sglang.assets.prompt_sets`;",
        f"the held-out split is never trained on). The target answered each prompt greedily "
        f"({data.generation_dtype}, up to {data.max_new_tokens} new tokens): {data.train_sequences} "
        f"sequences, {data.train_response_tokens} response tokens; {data.heldout_sequences} held-out "
        f"sequences for measurement. Regeneration took {data.generation_seconds / 3600:.2f} h.",
        "",
        "## Training",
        "",
        f"{summary.steps_done} of {config.steps} steps on {summary.device} "
        f"({summary.train_seconds / 3600:.2f} h, the frozen backbone's pass over the training blocks "
        f"included): {config.anchors_per_sequence} random blocks per sequence, {config.batch_rows} lattice "
        "rows per step, each a slot's row after the target's own previous token, where every slot up to it "
        "holds the target's token among its candidates; cross-entropy of the target's candidate weighted "
        f"exp(-e/{config.loss_decay:g}) by slot e; AdamW lr {config.lr:g} (warmup {config.warmup_steps} "
        f"steps, cosine to 0), weight decay {config.weight_decay:g}, fp32, seed {config.seed}."
        + (f" Last logged loss: {summary.final_loss:.3f} nats." if summary.final_loss is not None else ""),
        _backbone_history(summary.initialised_from),
        "",
        "## Held-out acceptance",
        "",
    ]
    report, base = summary.acceptance, summary.backbone_acceptance
    if report is None or base is None:
        lines.append("Not measured yet.")
    else:
        lines += [
            "Chain acceptance against the target's greedy continuation of held-out prompts: for each anchor,",
            "1 + the number of leading positions where the chain's token is the target's (at most "
            f"{drafter.block_size}); {report.blocks} blocks. DFlash2: the selector's greedy walk over the",
            f"lattice; DFlash: the backbone `{backbone}`'s top-1 token at every position, same blocks.",
            "",
            "| set | DFlash2 chain | DFlash chain |",
            "|---|---|---|",
            *(
                f"| {source} | {mean:.2f} | {base.by_source[source]:.2f} |"
                for source, mean in report.by_source.items()
            ),
            f"| all | {report.mean:.2f} | {base.mean:.2f} |",
        ]
    lines += [
        "",
        "## Use",
        "",
        "The reference engine plans trees over its lattice:",
        f'`bastion_sglang.reference.ReferenceEngine(target, "models/{name}", ...)`; so does SGLang\'s',
        f"BASTION worker: `--speculative-algorithm BASTION --speculative-draft-model-path models/{name}`.",
        "",
    ]
    return "\n".join(lines)
