"""One BASTION decode step, stage by stage: the drafter pass, planning, the verify pass, the accept walk
and the commit, with the seams the step calls (synthetic acceptance, step anatomy) and its metrics
(docs/architecture.md)."""
