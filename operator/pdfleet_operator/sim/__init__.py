"""`pdfleet simulate`: the operator's placement, autoscaler and rollback code driving a simulated fleet on a request
trace."""
