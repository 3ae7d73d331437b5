"""Exercise checks for the course (checks*.py, one module per group of notebooks), how
they talk (feedback.py), and the student versions of the notebooks (student.py)."""
from . import (checks, checks_compile, checks_fused, checks_layouts, checks_overlap_profiling, checks_own_model,
               checks_plan, checks_serve, checks_spmd_pipeline, checks_strategies)
from . import checks_experts, checks_tp_api
from .checks import *  # noqa: F401,F403
from .checks_compile import *  # noqa: F401,F403
from .checks_experts import *  # noqa: F401,F403
from .checks_fused import *  # noqa: F401,F403
from .checks_layouts import *  # noqa: F401,F403
from .checks_overlap_profiling import *  # noqa: F401,F403
from .checks_own_model import *  # noqa: F401,F403
from .checks_plan import *  # noqa: F401,F403
from .checks_serve import *  # noqa: F401,F403
from .checks_spmd_pipeline import *  # noqa: F401,F403
from .checks_strategies import *  # noqa: F401,F403
from .checks_tp_api import *  # noqa: F401,F403
from .feedback import REVEAL_AFTER, reset_tries, reveal
from .student import make_student_versions

__all__ = [name for mod in (checks, checks_compile, checks_fused, checks_layouts, checks_overlap_profiling,
                            checks_own_model, checks_plan, checks_serve, checks_spmd_pipeline,
                            checks_strategies, checks_experts, checks_tp_api)
           for name in mod.__all__] + ["reveal", "reset_tries", "REVEAL_AFTER",
                                       "make_student_versions"]
