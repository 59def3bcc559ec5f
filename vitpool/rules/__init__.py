"""Item rules the families build on: how an item is checked and sized without the weights.

Plain Python, importing neither torch nor transformers: an actor builds its family's rules from the
model's config and hands them to the pool's callers, who check, size and split items in their own
process before anything is sent. `grids` (spatial-merge towers: a (t, h, w) grid of patches),
`patch_rows` (towers that take one patch per row), `tiles` (fixed tiles), `paths` (an item of
several inputs, each run by graphs of its own).
"""
