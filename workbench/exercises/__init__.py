"""Exercise checks for the course (checks.py) and student versions (student.py)."""
from .checks import *  # noqa: F401,F403
from .checks import __all__ as _checks_all
from .checks_spmd_pipeline import *  # noqa: F401,F403
from .checks_spmd_pipeline import __all__ as _spmd_pipeline_all
from .checks_strategies import *  # noqa: F401,F403
from .checks_strategies import __all__ as _strategies_all
from .checks_own_model import *  # noqa: F401,F403
from .checks_own_model import __all__ as _own_model_all
from .student import make_student_versions

__all__ = [*_checks_all, *_spmd_pipeline_all, *_strategies_all, *_own_model_all,
           "make_student_versions"]
