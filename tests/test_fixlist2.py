"""fixlist2: defects left by earlier sessions, each held to plain PyTorch (or to a hand
count), one section per item."""
import pytest
import torch

from workbench.models.config import param_count
from workbench.serve.batching import StepPricer
from workbench.sim_mesh.profiles import get_profile


# ---- item 4: the KV cache's room counts every weight the server holds ----------------------
@pytest.mark.parametrize("name,bits,want", [
    # tiny (Llama, untied, fp32): linears 2 x (4 x 64 x 64 + 3 x 64 x 192) + head 75 x 64
    # = 111,296; embedding 75 x 64 + norms 2 x 2 x 64 + 64 = 5,120
    ("tiny", None, (111_296 + 5_120) * 4),
    ("tiny", 8, 111_296 * 1 + 5_120 * 4),
    # gpt-tiny (tied head, d_ff = 4 h = 256): linears 2 x (4 x 64 x 64 + 2 x 64 x 256)
    # = 98,304 (the tied head is the embedding: kept in dtype); embedding 75 x 64, position
    # table 64 x 64, biases 2 x (4 x 64 + 256 + 64), LayerNorms 2 x 2 x 128 + 128 = 10,688
    ("gpt-tiny", None, (98_304 + 10_688) * 4),
    ("gpt-tiny", 4, 98_304 // 2 + 10_688 * 4),
])
def test_kv_capacity_leaves_room_for_every_weight_held(name, bits, want):
    """Was: memory - the linears' bytes only (the embedding, and norms, biases, the
    position table left out): the room for the cache overstated."""
    p = StepPricer(name, "a100", weight_bits=bits)
    assert p.resident_bytes == want
    mem = get_profile("a100").memory_bytes
    assert p.kv_capacity() == int((mem * 0.9 - want) // p.kv_bytes_per_token)
    if bits is None:                     # every parameter of the module, each once
        assert p.resident_bytes == param_count(name).module * 4
