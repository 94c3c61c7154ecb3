"""dflow-rt: block-diffusion speculative decoding (DFlash drafting, DFlow relays)."""


from dflow_rt.config import RuntimeConfig
from dflow_rt.engine.generation import GenerateOutput, generate
from dflow_rt.engine.runtime import Runtime
from dflow_rt.errors import BusyError, CheckpointError, DflowError, InputError, RequestError
from dflow_rt.graphs import compile_cache  # noqa: F401  (on import: torch's cache directory, see there)
from dflow_rt.models.checkpoint import load_drafter, load_target, save_model
from dflow_rt.models.drafter import Drafter, DrafterConfig
from dflow_rt.models.target import Target, TargetConfig

__all__ = [
    "BusyError", "CheckpointError", "DflowError", "Drafter", "DrafterConfig", "GenerateOutput", "InputError",
    "RequestError", "Runtime", "RuntimeConfig", "Target", "TargetConfig", "generate", "load_drafter", "load_target",
    "save_model",
]
