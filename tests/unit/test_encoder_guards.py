"""The in-process encoder's guards, on a CPU: a call's argument must be a list (the pool's
TypeError), one item's size is bounded as a pool bounds it (`max_item_tokens`), and an item too
large for the device's memory is refused on its own, naming the memory it asked for, while the
call's other items are still encoded."""

from __future__ import annotations

import pytest
import torch
from conftest import ROW_WIDTH, image, make_encoder

from vitpool import Embedding, GraphEncoder, Image
from vitpool.encoder_spec import DEFAULT_MAX_ITEM_TOKENS
from vitpool.errors import ConfigError, InvalidItemError
from vitpool.graphs.inputs import NONFINITE_MESSAGE
from vitpool.pool.encoder_pool import _checked_list
from vitpool.pool.item_checks import checked_item
from vitpool.pool.settings import PoolSettings

NOT_A_LIST = "items must be a list of vitpool.Image / vitpool.Video; got"
CPU_REFUSAL = (  # what the CPU allocator raised for the 102 400-token item of issue 43
    "[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: not enough memory: "
    "you tried to allocate 167772160000 bytes."
)
GPU_REFUSAL = "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def image_of(num_tokens: int) -> Image:
    """An image of `num_tokens` output tokens (4 patch rows a token) whose pixels take no memory."""
    return Image(torch.zeros(1, ROW_WIDTH).expand(4 * num_tokens, ROW_WIDTH), (1, 2, 2 * num_tokens))


def assert_same_embeddings(got: Embedding, expected: Embedding) -> None:
    torch.testing.assert_close(got.tokens, expected.tokens)
    for got_deepstack, expected_deepstack in zip(got.deepstack, expected.deepstack, strict=True):
        torch.testing.assert_close(got_deepstack, expected_deepstack)


# ---- a call's argument ----

NOT_LISTS = {  # what a caller passes instead of a list -> the type the TypeError names
    # the pixels alone: was "Boolean value of Tensor ... is ambiguous"
    "a tensor": (lambda: torch.randn(16, ROW_WIDTH), "Tensor"),
    "a single item": (lambda: image(4, 4), "Image"),
    "a dict": (lambda: {"image": image(4, 4)}, "dict"),
    "a generator": (lambda: (item for item in [image(4, 4)]), "generator"),
    "a string": (lambda: "photo.jpg", "str"),  # a sequence, but not of items
    "None": (lambda: None, "NoneType"),
}


@pytest.mark.parametrize("case", sorted(NOT_LISTS))
def test_a_call_that_is_not_a_list_raises_the_pools_type_error(tiny_adapter, case):
    encoder = make_encoder(tiny_adapter, [16])
    build, type_name = NOT_LISTS[case]
    for encode in (
        encoder.encode,
        lambda items: encoder.encode(items, return_exceptions=True),
        encoder.encode_each,
    ):
        with pytest.raises(TypeError) as raised:
            encode(build())
        assert str(raised.value) == f"{NOT_A_LIST} {type_name}"
    with pytest.raises(TypeError) as from_pool:  # the pool's caller says the same
        _checked_list(build())
    assert str(from_pool.value) == str(raised.value)
    assert encoder.stats().replays_per_budget == {}


def test_an_empty_call_gives_an_empty_list_and_a_tuple_is_a_list(tiny_adapter):
    encoder = make_encoder(tiny_adapter, [16])
    for empty in ([], ()):
        assert encoder.encode(empty) == []
        assert encoder.encode(empty, return_exceptions=True) == []
    [embedding] = encoder.encode((image(4, 4),))
    assert embedding.tokens.shape[0] == 4


# ---- the bound on one item's size ----


def test_the_default_bound_is_the_pools(tiny_adapter):
    assert make_encoder(tiny_adapter, [16]).max_item_tokens == DEFAULT_MAX_ITEM_TOKENS == 16384
    assert PoolSettings().max_item_tokens == DEFAULT_MAX_ITEM_TOKENS


def test_an_item_100x_the_largest_budget_is_refused_by_index_before_any_work(tiny_adapter):
    """Issue 43: 102 400 tokens ran 19.5 s and then failed the whole call in the allocator, with
    no index; the pool refused it in its caller at once."""
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    good = image(4, 4)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good, image_of(100 * 1024)])
    assert raised.value.index == 1
    message = str(raised.value)
    assert message.startswith("item 1: 102400 output tokens (409600 pixel rows) is over this encoder's bound")
    assert "max_item_tokens=16384" in message and "build the encoder with a larger max_item_tokens" in message
    assert encoder.stats().replays_per_budget == {} and encoder.stats().eager_batches == 0  # nothing ran
    # return_exceptions: the good items of the same call are kept
    first, refused, last = encoder.encode([good, image_of(100 * 1024), good], return_exceptions=True)
    assert isinstance(refused, InvalidItemError) and refused.index == 1 and str(refused) == message
    [alone] = encoder.encode([good])
    assert_same_embeddings(first, alone)
    assert_same_embeddings(last, alone)
    assert encoder.stats().eager_batches == 0  # the refused item never ran


def test_the_bound_is_a_setting_and_none_lifts_it(tiny_adapter):
    at_bound, over_bound = image(8, 8), image(8, 10)  # 16 and 20 output tokens
    bounded = make_encoder(tiny_adapter, [16], max_item_tokens=16)
    [embedding] = bounded.encode([at_bound])
    assert embedding.tokens.shape[0] == 16
    with pytest.raises(InvalidItemError, match=r"item 0: 20 output tokens .*max_item_tokens=16"):
        bounded.encode([over_bound])
    unbounded = make_encoder(tiny_adapter, [16], max_item_tokens=None)
    [embedding] = unbounded.encode([over_bound])  # over every budget: runs eager, alone
    assert embedding.tokens.shape[0] == 20 and unbounded.stats().eager_batches == 1


BAD_BOUNDS = {  # max_item_tokens -> why it is refused
    "zero": 0,  # no item could pass
    "negative": -1,
    "a bool": True,  # an int to Python, a mistake here
    "a float": 16384.0,
    "a string": "16384",
}


@pytest.mark.parametrize("case", sorted(BAD_BOUNDS))
def test_an_invalid_bound_is_a_config_error(tiny_adapter, case):
    with pytest.raises(ConfigError, match="max_item_tokens must be a positive number of output tokens"):
        make_encoder(tiny_adapter, [16], max_item_tokens=BAD_BOUNDS[case])


def test_the_pools_bound_message_is_unchanged(tiny_adapter):
    """The check is shared with the pool (`vitpool.items.check_token_bound`): the pool's caller
    still says what it said."""
    with pytest.raises(InvalidItemError) as raised:
        checked_item(3, image_of(100 * 1024), tiny_adapter.item_rules, DEFAULT_MAX_ITEM_TOKENS)
    assert str(raised.value) == (
        "item 3: 102400 output tokens (409600 pixel rows) is over this pool's bound, max_item_tokens=16384: "
        "resize it as the model's processor does (its max_pixels), or launch the pool with a larger "
        "max_item_tokens (None: no bound)"
    )


# ---- an item too large for the device's memory ----

REFUSALS = {  # how the device's allocator refuses -> what the item's error says it asked for
    "cpu": (lambda: RuntimeError(CPU_REFUSAL), "156.2 GiB (167772160000 bytes)"),
    "cuda": (lambda: torch.OutOfMemoryError(GPU_REFUSAL), "20.0 GiB (21474836480 bytes)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_an_eager_item_that_does_not_fit_memory_is_refused_alone(tiny_adapter, monkeypatch, case):
    """Items over every budget run eager, each alone; the one whose run the allocator refuses gets
    its own InvalidItemError naming the memory it asked for, and runs only once; the call's other
    items, budgeted and eager, are encoded."""
    refusal, asked = REFUSALS[case]
    items = [image(4, 4), image(12, 12), image(6, 12), image(4, 6)]  # 4, 36 (eager), 18 (eager), 6 tokens
    reference = make_encoder(tiny_adapter, [16])
    expected = [reference.encode([item])[0] for item in items]
    encoder = make_encoder(tiny_adapter, [16], max_item_tokens=None)
    runner = encoder._runners[""]
    real_run_exact = runner.run_exact
    refused_runs = []

    def run_exact(members):
        if sum(member.spec.num_rows for member in members) > 100:  # the 36-token item's 144 rows
            refused_runs.append(len(members))
            raise refusal()
        return real_run_exact(members)

    monkeypatch.setattr(runner, "run_exact", run_exact)
    outcomes = encoder.encode(items, return_exceptions=True)
    kinds = [type(outcome).__name__ for outcome in outcomes]
    assert kinds == ["Embedding", "InvalidItemError", "Embedding", "Embedding"]
    refused = outcomes[1]
    assert refused.index == 1
    assert str(refused).startswith(
        "item 1: 36 output tokens (144 pixel rows, eager: over every budget) ran out of cpu memory"
    )
    assert f"it asked for {asked} at once" in str(refused) and "max_item_tokens below 36" in str(refused)
    for position in (0, 2, 3):
        assert_same_embeddings(outcomes[position], expected[position])
    assert refused_runs == [1]  # refused without running again
    with pytest.raises(InvalidItemError, match="item 1: 36 output tokens .* ran out of cpu memory"):
        encoder.encode(items)


def test_a_batch_out_of_memory_runs_in_halves_and_errors_keep_their_index(tiny_adapter, monkeypatch):
    """A budgeted batch of four items runs out of memory: its halves, then single items, run; a
    non-finite item in the second half keeps its own index."""
    bad = image(2, 4)
    bad.pixel_values[0, 0] = float("nan")
    items = [image(4, 4), image(2, 4), image(4, 2), bad]  # one batch of the 64-token budget
    reference = make_encoder(tiny_adapter, [64])
    expected = [reference.encode([item])[0] for item in items[:3]]
    encoder = make_encoder(tiny_adapter, [64])
    runner = encoder._runners[""]
    real_launch = runner.launch

    def launch(batches, to_host, between=None):
        if any(len(members) > 1 for _, members in batches):
            raise torch.OutOfMemoryError(GPU_REFUSAL)
        return real_launch(batches, to_host, between)

    monkeypatch.setattr(runner, "launch", launch)
    outcomes = encoder.encode(items, return_exceptions=True)
    for position in range(3):
        assert_same_embeddings(outcomes[position], expected[position])
    assert isinstance(outcomes[3], InvalidItemError) and outcomes[3].index == 3
    assert outcomes[3].reason == NONFINITE_MESSAGE
    assert sum(encoder.stats().replays_per_budget.values()) == 4  # each item alone, at last


def test_an_error_that_is_not_out_of_memory_still_fails_the_call(tiny_adapter, monkeypatch):
    """Only the allocator's refusal is an item's own: any other failure is the encoder's."""
    encoder = make_encoder(tiny_adapter, [16])
    runner = encoder._runners[""]

    def run_exact(members):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runner, "run_exact", run_exact)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        encoder.encode([image(4, 4), image(12, 12)], return_exceptions=True)
