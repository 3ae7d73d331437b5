"""Hypothesis strategies shared by the tests: meshes, shapes, placements."""
import math

from hypothesis import strategies as st

import workbench as wb


@st.composite
def meshes(draw, max_ranks=16, max_dims=3):
    nd = draw(st.integers(1, max_dims))
    shape = []
    for _ in range(nd):
        room = max_ranks // max(1, math.prod(shape))
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    perm = draw(st.permutations(list(range(math.prod(shape)))))
    flat = list(perm)
    def nest(f, s):
        if len(s) == 1:
            return list(f)
        k = len(f) // s[0]
        return [nest(f[i * k:(i + 1) * k], s[1:]) for i in range(s[0])]
    names = ["dp", "tp", "pp"][:nd]
    return wb.Mesh(nest(flat, shape), dim_names=names)


def placements(ndim_tensor, mesh_ndim, partial=True):
    """One placement per mesh dim; the Partials of one layout share one reduce op
    (a mix such as [P(sum), P(max)] is refused)."""
    opts = [wb.Replicate()] + [wb.Shard(d) for d in range(ndim_tensor)]

    def draw(op):
        choice = opts + ([wb.Partial(op)] if partial else [])
        return st.tuples(*[st.sampled_from(choice) for _ in range(mesh_ndim)])
    return st.sampled_from(["sum", "max", "avg"]).flatmap(draw)


shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)
