"""The model families vitpool ships, one package each, everything of the family in it:

- `__init__.py`: its `FamilyRecord` (`RECORD`): its towers (how each is built and loaded from a
  checkpoint) and the facts every integration reads (vLLM's layout, the transformers drop-in's
  parts or its `get_image_features` stand-in, the processor kind, Dynamo). Plain data: importing it
  imports neither torch nor transformers.
- `adapter.py`: the `VisionAdapter` over its tower (and projector), with its checkpoint conversion.
- `rules.py` where its items follow rules of its own (torch-free: a pool's callers run them).

The registry (`vitpool.models.registry`) finds every package here; adding a family is its folder
and its test case (`tests/unit/family_cases/<family>.py`), which every cross-family test finds.
"""
