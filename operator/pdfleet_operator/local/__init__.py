"""The local backend: `pdfleet up` runs an InferenceDeployment as router and worker processes on this machine, and
`pdfleet load` drives it."""
