"""The tensor-parallel sizes refused at start-up are exactly those whose ranks could not build
the model's attention (layers/linear.py's QKVLinear, built as each rank would), and the
refusal names the sizes that work."""

from types import SimpleNamespace

import pytest

from tokenmill.config.engine import EngineConfig
from tokenmill.distributed.parallel_state import as_rank
from tokenmill.layers.linear import QKVLinear
from tokenmill.models.info import check_tensor_parallel, tensor_parallel_sizes


def _builds(heads: int, kv: int, tp: int) -> bool:
    try:
        for rank in range(tp):
            with as_rank(rank, tp):
                QKVLinear(8, 4, heads, kv)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("heads,kv", [(9, 3), (8, 2), (12, 12), (16, 4), (6, 1)])
def test_the_sizes_are_those_every_rank_can_build(heads, kv):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    assert tensor_parallel_sizes(config) == [n for n in range(1, 2 * heads + 1)
                                             if _builds(heads, kv, n)]


def test_a_size_that_cannot_split_the_heads_is_one_line_naming_those_that_can():
    smollm = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)  # the default model
    check_tensor_parallel(EngineConfig(model="unused", tensor_parallel_size=3), smollm)
    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(EngineConfig(model="unused", tensor_parallel_size=2), smollm)
    assert str(refused.value) == (
        "tensor parallel size 2 (--tensor-parallel-size / MP_NUM) must divide the model's "
        "attention heads (9; and its 3 key/value heads, or be a multiple of them): sizes that "
        "can: 1, 3, 9.")
