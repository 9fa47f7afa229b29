"""The simulated vLLM engine as a real server (`epp-sim serve-engine`); see docs/simulator.md."""

from simulator.serving.config import EngineServerConfig
from simulator.serving.server import SimulatedEngineServer

__all__ = ["EngineServerConfig", "SimulatedEngineServer"]
