"""The simulated mesh: devices, collectives, cost model, hardware profiles, trace."""
from .mesh import Mesh
from .device_mesh_api import init_device_mesh
from .trace import Event, Trace, trace, current_trace
from .profiles import Profile, Link, get_profile, list_profiles, load_profile
from . import collectives, cost, estimates, hierarchical, nic_assist

__all__ = ["Mesh", "init_device_mesh", "Event", "Trace", "trace", "current_trace", "Profile", "Link",
           "get_profile", "list_profiles", "load_profile", "collectives", "cost", "estimates",
           "hierarchical", "nic_assist"]
