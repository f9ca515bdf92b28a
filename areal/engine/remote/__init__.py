"""The parts of a rollout worker's inference engine, composed by ``RemoteInfEngine``."""
