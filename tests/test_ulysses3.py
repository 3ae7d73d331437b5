"""Follow-ups to DeepSpeed-Ulysses (``cp_comm="a2a"``) in the planner: the refusal of an
unfused kernel names the cp method in use; ``search`` tries the all-to-all where the heads
allow it (``plan.ep_cp_search``)."""
import pytest

from workbench.models.config import get_config
from workbench.plan import Cluster, Layout, estimate

# tests/test_ulysses.py's two GQA blocks (16 heads, 4 K/V heads, s = 1024), as a GPT: the
# default attention a GPT is priced with is the unfused one
GPT = get_config("gpt-22b", n_layer=2, d_model=1024, n_head=16, d_ff=4096,
                 seq_len=1024)


@pytest.mark.parametrize("comm,says,not_says", [("a2a", "all-to-all (DeepSpeed-Ulysses)", "ring"),
                                                 ("p2p", "ring attention", "Ulysses")])
def test_unfused_attention_refusal_names_the_cp_method(comm, says, not_says):
    """Before: cp_comm='a2a' was refused with "runs ring attention"."""
    lay = Layout(cp=2, global_batch=1, cp_comm=comm)
    with pytest.raises(ValueError) as e:
        estimate(GPT, lay, Cluster("a100", 2), attention="materialized")
    msg = str(e.value)
    assert says in msg and not_says not in msg and "attention='flash'" in msg
    assert f"cp_comm={comm!r}" in msg
    estimate(GPT, lay, Cluster("a100", 2), attention="flash")       # the fix runs
