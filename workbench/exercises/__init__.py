"""Exercise checks for the course (checks*.py), how they talk (feedback.py), and the
student versions of the notebooks (student.py)."""
from .checks import *  # noqa: F401,F403
from .checks import __all__ as _checks_all
from .checks_spmd_pipeline import *  # noqa: F401,F403
from .checks_spmd_pipeline import __all__ as _spmd_pipeline_all
from .checks_strategies import *  # noqa: F401,F403
from .checks_strategies import __all__ as _strategies_all
from .checks_overlap_profiling import *  # noqa: F401,F403
from .checks_overlap_profiling import __all__ as _overlap_profiling_all
from .checks_plan import *  # noqa: F401,F403
from .checks_plan import __all__ as _plan_all
from .feedback import REVEAL_AFTER, reset_tries, reveal
from .student import make_student_versions

__all__ = [*_checks_all, *_spmd_pipeline_all, *_strategies_all, *_overlap_profiling_all, *_plan_all,
           "reveal", "reset_tries", "REVEAL_AFTER", "make_student_versions"]
