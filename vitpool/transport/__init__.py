"""How batches travel between a caller and an encoder actor, behind one interface (`link.ActorLink`):

- `link`: the seam: the link protocol, the batch receipt and a batch's outcomes;
- `links`: `make_link`, the link to one actor;
- `ray_link`: the Ray call; `channel_link`: the same-node channel, with Ray behind it;
- `channel` (`channel_protocol`, `channel_server`, `channel_client`, `segments`): the same-node
  channel over shared memory;
- `wire`: tensors as NumPy arrays.

Knows no model: it carries item specs, pixels of any shape and outputs laid out by
`vitpool.specs.OutputLayout`. Importing this package imports none of its modules.
"""
