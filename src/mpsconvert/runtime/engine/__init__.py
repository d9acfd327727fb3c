"""One generation engine: a static-cache decoder over the loaded model (`Engine`: prefill, decode
step, replayed as a CUDA graph on CUDA), sampling, and the one loop (`generate_ids`) that
`generate`, `chat`, validate's decode latency, the Apple checks' PyTorch reference and the
benchmarks drive; the Apple exports' stateful runners plug into the same loop (`RunnerDecoder`).
"""

from .decoder import DECODE_PATHS, Engine, compiles_by_default, decode_path
from .loop import Decoder, GenerationStats, RunnerDecoder, generate_ids, peak_memory
from .sampling import Draws, Sampling, next_token
from .text import Conversation, TextStream, eos_ids, load_generation_config, load_tokenizer

__all__ = [
    "DECODE_PATHS",
    "Conversation",
    "Decoder",
    "Draws",
    "Engine",
    "GenerationStats",
    "RunnerDecoder",
    "Sampling",
    "TextStream",
    "compiles_by_default",
    "decode_path",
    "eos_ids",
    "generate_ids",
    "load_generation_config",
    "load_tokenizer",
    "next_token",
    "peak_memory",
]
