"""Exercise checks for the course (checks*.py), how they talk (feedback.py), and the
student versions of the notebooks (student.py)."""
from .checks import *  # noqa: F401,F403
from .checks import __all__ as _checks_all
from .checks_layouts import *  # noqa: F401,F403
from .checks_layouts import __all__ as _layouts_all
from .checks_spmd_pipeline import *  # noqa: F401,F403
from .checks_spmd_pipeline import __all__ as _spmd_pipeline_all
from .checks_strategies import *  # noqa: F401,F403
from .checks_strategies import __all__ as _strategies_all
from .checks_fused import *  # noqa: F401,F403
from .checks_fused import __all__ as _fused_all
from .feedback import REVEAL_AFTER, reset_tries, reveal
from .student import make_student_versions

__all__ = [*_checks_all, *_layouts_all, *_spmd_pipeline_all, *_strategies_all, *_fused_all, "reveal", "reset_tries",
           "REVEAL_AFTER", "make_student_versions"]
