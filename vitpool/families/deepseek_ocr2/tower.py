"""DeepSeek-OCR-2's tower run from its parts: `DeepseekOcr2Encoder` (the tower, the projector, the
separator and each path's shape-only tables) and `tile_features`, its forward on a path's tiles,
with the reference path and the fused one taken on CUDA in half precision. Tiles of another size
than their path's (crops no graph serves, run eagerly) get their tables made on first use, kept
per size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vitpool.kernels.fused import fused_ops_apply, fused_rotary, triton_available
from vitpool.models.compat import check_tower_parts
from vitpool.models.tiled import GLOBAL_VIEW, LOCAL_CROPS, CropSize, TablesBySize

GLOBAL, LOCAL = GLOBAL_VIEW, LOCAL_CROPS
# The tower picks its query table by the SAM token count (`DeepseekOcr2VisionModel.forward`).
MAX_PATCHES_OF_SMALL_QUERIES = 144
# What `tile_features` reads of the tower, checked when the module is built: a transformers release
# that lacks one fails there, not mid-forward.
TOWER_PARTS = (
    "sam_encoder.config",
    "sam_encoder.patch_embed",
    "sam_encoder.pos_embed",
    "sam_encoder.interpolate_pos_encoding",
    "sam_encoder.layers.0.layer_norm1",
    "sam_encoder.layers.0.layer_norm2",
    "sam_encoder.layers.0.mlp",
    "sam_encoder.layers.0.window_size",
    "sam_encoder.layers.0.window_partition",
    "sam_encoder.layers.0.window_unpartition",
    "sam_encoder.layers.0.attn.qkv",
    "sam_encoder.layers.0.attn.proj",
    "sam_encoder.layers.0.attn.num_attention_heads",
    "sam_encoder.layers.0.attn.use_rel_pos",
    "sam_encoder.neck",
    "sam_encoder.proj",
    "vision_encoder.config",
    "vision_encoder.rotary_emb",
    "vision_encoder.norm",
    "vision_encoder.norm.variance_epsilon",
    "vision_encoder.layers.0.input_layernorm.variance_epsilon",
    "vision_encoder.layers.0.post_attention_layernorm.variance_epsilon",
    "vision_encoder.layers.0.mlp.gate_proj",
    "vision_encoder.layers.0.mlp.up_proj",
    "vision_encoder.layers.0.mlp.down_proj",
    "vision_encoder.layers.0.mlp.act_fn",
    "vision_encoder.layers.0.self_attn.q_proj",
    "vision_encoder.layers.0.self_attn.k_proj",
    "vision_encoder.layers.0.self_attn.v_proj",
    "vision_encoder.layers.0.self_attn.o_proj",
    "vision_encoder.layers.0.self_attn.head_dim",
    "vision_encoder.layers.0.self_attn.scaling",
    "query_768_resolution",
    "query_1024_resolution",
)


def relative_index(size: int) -> torch.Tensor:
    """[size, size] rows of SAM's resized relative-position table for a size x size query grid
    against itself: `get_rel_pos`'s index, (q - k) + size - 1."""
    positions = torch.arange(size)
    return positions[:, None] - positions[None, :] + (size - 1)


def key_positions(size: int) -> torch.Tensor:
    """[size * size, E] float: key k's row and column one-hot, [onehot(k // size), onehot(k % size)],
    zero-padded to E = 2 * size rounded up to a multiple of 8 (see `sam_attention`)."""
    tokens = torch.arange(size * size)
    width = -(-2 * size // 8) * 8
    onehot = torch.zeros(size * size, width)
    onehot[tokens, tokens // size] = 1.0
    onehot[tokens, size + tokens % size] = 1.0
    return onehot


def encoder_mask(num_patches: int, num_queries: int) -> torch.Tensor:
    """[L, L] bool, True where attention is allowed: the SAM tokens see each other both ways and
    no query; query k sees every SAM token and queries 0..k (what `create_causal_mask` builds
    from the tower's `block_sequence_ids`)."""
    length = num_patches + num_queries
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[:num_patches, :num_patches] = True
    return allowed


def sam_tokens(grid: int) -> int:
    """SAM tokens of a tile `grid` patches a side: after the two stride-2 convolutions, each
    rounding up."""
    side = (((grid + 1) // 2) + 1) // 2
    return side * side


# The tower's own forward cannot be captured: SAM's `get_rel_pos` indexes its tables with tensors
# made on the host at every call, and its attention classes do not go through transformers'
# attention interface. So the encoder keeps, as buffers, each size's relative-position indices and
# each path's encoder mask and positions, and `tile_features` runs the tower's parts with them (the
# family's one seam), with SDPA for both attentions.
class DeepseekOcr2Encoder(torch.nn.Module):
    """The tower, the projector, the separator, and each path's shape-only tables (buffers, so
    they move with the module to the encoder's device).

    Args:
        vision_tower: `DeepseekOcr2VisionModel`; its SAM's `image_size` is the global view's side.
        projector: `DeepseekOcr2Model.multi_modal_projector` (Linear: encoder width -> LLM width).
        view_separator: `DeepseekOcr2Model.view_separator` [LLM width] (copied).
        local_image_size: the side of a local crop in pixels (the processor's `tile_size`), or that
            and where it was set (`DeepseekOcr2Adapter.crop_size`), named when crops of another
            size run eagerly.

    Raises:
        ConfigError: the tower lacks a part `tile_features` runs (another transformers release).
        ValueError: tiles smaller than one patch.
    """

    def __init__(
        self,
        vision_tower: torch.nn.Module,
        projector: torch.nn.Module,
        view_separator: torch.Tensor,
        local_image_size: int | CropSize,
    ) -> None:
        super().__init__()
        check_tower_parts("DeepSeek-OCR-2", vision_tower, TOWER_PARTS)
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.view_separator = torch.nn.Parameter(view_separator.detach().clone(), requires_grad=False)
        self.config = vision_tower.config
        sam = vision_tower.sam_encoder.config
        patch = sam.patch_size
        if not isinstance(patch, int) or not isinstance(sam.image_size, int):
            raise ValueError(  # noqa: TRY004 - an unsupported config value (non-square), not a wrong argument
                f"DeepSeek-OCR-2 needs square patches and views (one integer each); got patch_size "
                f"{patch!r}, image_size {sam.image_size!r}"
            )
        self.patch_size = patch
        self.crop = CropSize.of(local_image_size)
        self.tile_sizes = {GLOBAL: sam.image_size, LOCAL: self.crop.pixels}
        self.grids: dict[str, int] = {}  # patches per side of a path's tile
        rel_sizes = {int(sam.window_size)}
        for path, size in self.tile_sizes.items():
            if size < patch:
                raise ValueError(
                    f"DeepSeek-OCR-2 {path} tiles of {size} pixels are smaller than one {patch}-pixel patch"
                )
            grid = size // patch  # as the patch convolution: pixels past the last whole patch are not read
            self.grids[path] = grid
            rel_sizes.add(grid)
            mask, positions = self._encoder_tables(grid)
            self.register_buffer(f"{path}_mask", mask, persistent=False)
            self.register_buffer(f"{path}_positions", positions, persistent=False)
        self.rel_sizes = frozenset(rel_sizes)
        for size in sorted(rel_sizes):
            self.register_buffer(f"rel_index_{size}", relative_index(size), persistent=False)
            self.register_buffer(f"key_positions_{size}", key_positions(size), persistent=False)
        self._other_sizes = TablesBySize()  # tables of tiles of another grid (run eagerly)

    def queries(self, grid: int) -> torch.Tensor:
        """[Q, width] learned queries of a tile `grid` patches a side: the table the tower picks by
        its SAM token count."""
        small = sam_tokens(grid) <= MAX_PATCHES_OF_SMALL_QUERIES
        return (
            self.vision_tower.query_768_resolution if small else self.vision_tower.query_1024_resolution
        ).weight

    def encoder_tables(self, path: str, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's mask [L, L] and positions [1, L] for a `path` tile `grid` patches a side:
        the path's buffers for its own tiles, else made once a grid."""
        if grid == self.grids[path]:
            return getattr(self, f"{path}_mask"), getattr(self, f"{path}_positions")
        device = self.view_separator.device
        return self._other_sizes.get(("encoder", grid), device, lambda: self._encoder_tables(grid))

    def rel_index(self, size: int) -> torch.Tensor:
        """`relative_index(size)`: a buffer for the windows' and the paths' sizes, else made once."""
        if size in self.rel_sizes:
            return getattr(self, f"rel_index_{size}")
        return self._other_sizes.get(
            ("rel_index", size), self.view_separator.device, lambda: relative_index(size)
        )

    def key_positions(self, size: int) -> torch.Tensor:
        """`key_positions(size)`: a buffer for the windows' and the paths' sizes, else made once."""
        if size in self.rel_sizes:
            return getattr(self, f"key_positions_{size}")
        return self._other_sizes.get(
            ("key_positions", size), self.view_separator.device, lambda: key_positions(size)
        )

    def _encoder_tables(self, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_patches, num_queries = sam_tokens(grid), self.queries(grid).shape[0]
        return encoder_mask(num_patches, num_queries), torch.arange(num_patches + num_queries)[None]


def rel_table(rel_pos: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`get_rel_pos` for a square grid with its index from a buffer: the table [R, d] resized
    (linearly) to 2 * size - 1 rows, then gathered: [size, size, d]."""
    length = 2 * index.shape[0] - 1
    table = rel_pos.reshape(1, rel_pos.shape[0], -1).transpose(1, 2)  # [1, d, R]
    resized = F.interpolate(table, size=length, mode="linear")
    return resized.reshape(-1, length).permute(1, 0)[index]


def sam_attention(
    attention: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """`DeepseekOcr2SamVisionSdpaAttention.forward` on [b, h, w, c] (h == w), with the relative
    positions' index and the keys' one-hot rows and columns from buffers.

    SAM adds a decomposed relative-position bias, rel_h[q, row(k)] + rel_w[q, column(k)], to the
    attention logits. Built as a mask it is [heads, h*w, h*w] per tile (200M values a global
    layer at 1024²), written and read again each layer: a large share of a view's encode
    (benchmarks/HISTORY.md, "Wave 2: Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6, and the tiled towers'
    fused and compiled kernels (issue 28)"). The same logits come from a longer dot product, with
    no mask: the query gains its rel_h and rel_w rows (divided by the softmax scale) and the key
    the one-hot of its row and column, so q'·k' * scale = q·k * scale + rel_h[q, row(k)] +
    rel_w[q, column(k)]; the value gains zero columns (one head size for the flash kernels), cut
    off after."""
    batch, height, width, _ = hidden.shape
    heads, tokens = attention.num_attention_heads, height * width
    qkv = attention.qkv(hidden).reshape(batch, tokens, 3, heads, -1).permute(2, 0, 3, 1, 4)
    query, key, value = qkv.unbind(0)  # [b, heads, h*w, d]
    head_size = query.shape[-1]
    scale = head_size**-0.5
    if attention.use_rel_pos:
        rows = query.reshape(batch * heads, height, width, -1)
        rel_h = torch.einsum("bhwc,hkc->bhwk", rows, rel_table(attention.rel_pos_h, index))
        rel_w = torch.einsum("bhwc,wkc->bhwk", rows, rel_table(attention.rel_pos_w, index))
        extra = torch.cat([rel_h, rel_w], dim=-1).reshape(batch, heads, tokens, -1) / scale
        extra_size = key_positions.shape[-1]  # h + w, rounded up to a multiple of 8
        query = torch.cat([query, F.pad(extra, (0, extra_size - extra.shape[-1])).to(query.dtype)], dim=-1)
        key = torch.cat([key, key_positions.to(key.dtype).expand(batch, heads, tokens, extra_size)], dim=-1)
        value = F.pad(value, (0, extra_size))
    output = F.scaled_dot_product_attention(query, key, value, scale=scale)[..., :head_size]
    output = output.reshape(batch, heads, height, width, -1).permute(0, 2, 3, 1, 4)
    output = output.reshape(batch, height, width, -1)
    return attention.proj(output)


def fused_sam_attention(
    attention: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """`sam_attention` (with relative positions) on the fused path: the same longer query and
    key, written into one buffer [b, h*w, 2, heads, d + E] in the layout of the qkv projection
    instead of built by `cat`s and `pad`s: one copy of q and k together, one write each of the
    keys' one-hot rows (cast as they are written) and the queries' scaled rel_h and rel_w, against
    about ten kernels that each read and wrote whole extended tensors (a noticeable share of a
    view's GPU time). The value keeps its head size: cuDNN's attention takes a value head
    smaller than the query's (the reference pads it for the flash kernel, which then multiplies
    the padding too). Figures: benchmarks/RESULTS.md, "Figures the code's design rests on"."""
    batch, height, width, _ = hidden.shape
    heads, tokens = attention.num_attention_heads, height * width
    qkv = attention.qkv(hidden).view(batch, tokens, 3, heads, -1)
    head_size, extra_size = qkv.shape[-1], key_positions.shape[-1]
    scale = head_size**-0.5
    extended = qkv.new_empty(batch, tokens, 2, heads, head_size + extra_size)
    extended[..., :head_size] = qkv[:, :, :2]
    query, key = extended.unbind(2)  # [b, h*w, heads, d + E]
    key[..., head_size:] = key_positions[:, None]
    value = qkv[:, :, 2]
    rows = qkv[:, :, 0].view(batch, height, width, heads, head_size)
    extra = query[..., head_size:].view(batch, height, width, heads, extra_size)
    rel_h = torch.einsum("bhwnc,hkc->bhwnk", rows, rel_table(attention.rel_pos_h, index))
    rel_w = torch.einsum("bhwnc,wkc->bhwnk", rows, rel_table(attention.rel_pos_w, index))
    torch.div(rel_h, scale, out=extra[..., :height])
    torch.div(rel_w, scale, out=extra[..., height : height + width])
    extra[..., height + width :] = 0
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    output = F.scaled_dot_product_attention(query, key, value, scale=scale)
    return attention.proj(output.transpose(1, 2).reshape(batch, height, width, -1))


def attend_sam(
    attention: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """`fused_sam_attention` where the fused ops apply, else the reference `sam_attention`."""
    if attention.use_rel_pos and fused_ops_apply(hidden):
        return fused_sam_attention(attention, hidden, index, key_positions)
    return sam_attention(attention, hidden, index, key_positions)


def sam_features(encoder: DeepseekOcr2Encoder, pixels: torch.Tensor) -> torch.Tensor:
    """`DeepseekOcr2SamVisionEncoder.forward` on tiles [n, C, S, S]: [n, P, width]."""
    sam = encoder.vision_tower.sam_encoder
    grid = pixels.shape[-1] // encoder.patch_size
    hidden = sam.patch_embed(pixels)  # [n, grid, grid, hidden]: a view of the convolution's NCHW output
    if fused_ops_apply(hidden):
        # one copy into [n, grid, grid, hidden] order: else every add of the residual stream keeps
        # the NCHW order (strided kernels, a large share of SAM's time: benchmarks/RESULTS.md,
        # "Figures the code's design rests on") and each layer norm copies its input
        hidden = hidden.contiguous()
    if sam.pos_embed is not None:
        hidden = hidden + sam.interpolate_pos_encoding(grid, grid)
    for layer in sam.layers:
        residual, hidden = hidden, layer.layer_norm1(hidden)
        if layer.window_size > 0:
            hidden, padded = layer.window_partition(hidden, layer.window_size)
            size = layer.window_size
            hidden = attend_sam(layer.attn, hidden, encoder.rel_index(size), encoder.key_positions(size))
            hidden = layer.window_unpartition(hidden, layer.window_size, padded, (grid, grid))
        else:
            hidden = attend_sam(layer.attn, hidden, encoder.rel_index(grid), encoder.key_positions(grid))
        hidden = residual + hidden
        hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
    hidden = sam.proj(sam.neck(hidden))
    return hidden.flatten(2).transpose(1, 2)


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, as `apply_rotary_pos_emb` (rotate-half) applies them."""
    first, second = states.chunk(2, dim=-1)
    return states * cos + torch.cat((-second, first), dim=-1) * sin


def repeat_heads(states: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped-query attention's key or value heads [b, kv, L, d], each repeated for its group of
    query heads: [b, num_heads, L, d] (`repeat_kv`; a static expand, no host work)."""
    batch, kv_heads, length, dim = states.shape
    groups = num_heads // kv_heads
    repeated = states[:, :, None].expand(batch, kv_heads, groups, length, dim)
    return repeated.reshape(batch, num_heads, length, dim)


def encoder_layer(
    layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`DeepseekOcr2VisionEncoderLayer.forward` with SDPA under the path's mask (kept apart from
    transformers' attention interface, whose mask builder the tower's mask needs)."""
    attention = layer.self_attn
    states = layer.input_layernorm(hidden)
    batch, length, _ = states.shape
    shape = (batch, length, -1, attention.head_dim)
    query = rotate(attention.q_proj(states).view(shape).transpose(1, 2), cos, sin)
    key = rotate(attention.k_proj(states).view(shape).transpose(1, 2), cos, sin)
    value = attention.v_proj(states).view(shape).transpose(1, 2)
    key, value = repeat_heads(key, query.shape[1]), repeat_heads(value, query.shape[1])
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attention.scaling)
    hidden = hidden + attention.o_proj(output.transpose(1, 2).reshape(batch, length, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`DeepseekOcr2VisionRMSNorm` as torch's `rms_norm`, one kernel on CUDA (the module's own
    forward is about eight: casts, pow, mean, rsqrt, two muls). The same fp32 math, except that the
    weight multiplies before the one rounding to `hidden`'s dtype (the module rounds, then
    multiplies): within a unit in the last place in half precision, equal in fp32."""
    return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The path's boolean mask as an additive one in the compute dtype: 0 where allowed, -inf
    elsewhere (made once a forward; SDPA would convert the boolean mask at every layer)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask.logical_not(), float("-inf"))


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA of [b, L, heads, d] queries on [b, L, kv heads, d] keys and values under the additive
    mask `bias`: [b, L, heads, d]. cuDNN's kernel takes the grouped heads as they are
    (`enable_gqa`); where it cannot run, the heads are repeated for the memory-efficient kernel
    (which has no grouped-query support) as on the reference path."""
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    params = torch.backends.cuda.SDPAParams(query, key, value, bias, 0.0, False, True)
    if not torch.backends.cuda.can_use_cudnn_attention(params):
        key, value = repeat_heads(key, query.shape[1]), repeat_heads(value, query.shape[1])
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=True)
    return output.transpose(1, 2)


def fused_encoder_layer(
    layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """`encoder_layer` on the fused path, updating `hidden` [b, L, width] (contiguous, this
    forward's own) in place: torch's RMSNorm, the Triton rotary (fp32 cos, sin [L, head_dim], one
    table for every tile), `masked_attention`, and each residual added by its GEMM (o_proj and
    down_proj have no bias), so no elementwise add is launched."""
    attention, mlp = layer.self_attn, layer.mlp
    batch, length, width = hidden.shape
    rows, heads = (batch * length, -1, attention.head_dim), (batch, length, -1, attention.head_dim)
    states = rms_norm(layer.input_layernorm, hidden)
    query = fused_rotary(attention.q_proj(states).view(rows), cos, sin).view(heads)
    key = fused_rotary(attention.k_proj(states).view(rows), cos, sin).view(heads)
    value = attention.v_proj(states).view(heads)
    output = masked_attention(query, key, value, bias, attention.scaling)
    flat = hidden.view(batch * length, width)
    flat.addmm_(output.reshape(batch * length, -1), attention.o_proj.weight.t())
    states = rms_norm(layer.post_attention_layernorm, hidden)
    gated = mlp.act_fn(mlp.gate_proj(states)) * mlp.up_proj(states)
    flat.addmm_(gated.view(batch * length, -1), mlp.down_proj.weight.t())
    return hidden


def fused_encoder_fits(hidden: torch.Tensor, layers: torch.nn.ModuleList) -> bool:
    """Whether the encoder may run `fused_encoder_layer`: fused ops on `hidden`, Triton, and
    weights in `hidden`'s dtype with no bias where a residual joins its GEMM."""
    if not (fused_ops_apply(hidden) and triton_available()):
        return False
    return all(
        linear.bias is None and linear.weight.dtype == hidden.dtype
        for layer in layers
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj)
    )


def tile_features(encoder: DeepseekOcr2Encoder, path: str, pixels: torch.Tensor) -> torch.Tensor:
    """`DeepseekOcr2VisionModel.forward` on tiles [n, C, S, S] of `path` (S its own size, or, run
    eagerly, another crop side), with the tables from buffers: [n, Q, width], the queries' outputs
    (the model's `last_hidden_state`)."""
    vision = encoder.vision_tower.vision_encoder
    grid = pixels.shape[-1] // encoder.patch_size
    patches = sam_features(encoder, pixels)  # [n, P, width]
    queries = encoder.queries(grid)
    hidden = torch.cat([patches, queries[None].expand(patches.shape[0], -1, -1)], dim=1)
    layers = vision.layers[: vision.config.num_hidden_layers]
    num_patches = patches.shape[1]
    mask, positions = encoder.encoder_tables(path, grid)
    if fused_encoder_fits(hidden, layers):
        # the rotary kernel takes fp32 tables: the rotary's own math before it rounds to x's dtype
        cos, sin = vision.rotary_emb(hidden.new_empty((), dtype=torch.float32), positions)
        bias = attention_bias(mask, hidden.dtype)
        for layer in layers:
            hidden = fused_encoder_layer(layer, hidden, cos[0], sin[0], bias)
        return rms_norm(vision.norm, hidden)[:, num_patches:]
    cos, sin = vision.rotary_emb(hidden, positions)  # [1, L, head_dim]
    cos, sin = cos[:, None], sin[:, None]
    for layer in layers:
        hidden = encoder_layer(layer, hidden, cos, sin, mask)
    return vision.norm(hidden)[:, num_patches:]
