"""Exercise checks for the course (checks.py) and student versions (student.py)."""
from .checks import *  # noqa: F401,F403
from .checks import __all__ as _checks_all
from .student import make_student_versions

__all__ = [*_checks_all, "make_student_versions"]
