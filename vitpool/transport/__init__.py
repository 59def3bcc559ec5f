"""How batches travel between a caller and an encoder actor: the wire helpers (tensors as NumPy
arrays), the same-node channel with its shared-memory segments, and the Ray call, behind one
interface. Knows no model: it carries item specs, pixels of any shape and outputs laid out by
`vitpool.specs.OutputLayout`."""
