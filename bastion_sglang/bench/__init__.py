"""`bastion bench`: every policy through the real in-process `sglang.Engine`, on the same prompts, repeated.

Modules, in the order a run goes through them:
- `cli`: the command (`HELP`, `add_arguments`, `run`): its usage and the policies it knows;
- `plan`: every check before any Engine starts: policies, temperatures and settings, the prompts loaded
  and tokenized, each Engine's server arguments, each repeat's policy order;
- `run`: the repeats on the chosen schedule (one Engine at a time, or all of a repeat's taking turns);
  `server` (one policy's Engine in a process of its own, driven batch by batch), `measure` (one policy at one
  temperature), `streaming` (chunk arrivals and decode timing), `histograms` (the worker's Prometheus
  histograms);
- `report`: the `bench.json` models and the definition of every field; `aggregate` (rows over the repeats,
  speedups, the best policy per temperature); `output` (tables, plot and files).
"""
