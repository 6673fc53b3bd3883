"""`pdfleet simulate`: the operator's placement, autoscaler and rollback code driving a simulated fleet on a request
trace."""

from pdfleet_operator.sim import native as _native

# the event loop compiled (sim/native.py) when a build of these very sources exists; else interpreted
_native.enable(__path__)
