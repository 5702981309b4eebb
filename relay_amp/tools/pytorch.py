"""pytorch: PyTorch twins of the built-in models (same architecture and shapes), run for side-by-side columns.

Only the timing is compared, so the twins have their own random weights. Needs the `torch` extra.
"""

import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable

from ..errors import MissingDependencyError, OptionError
from ..targets import host_supports

TORCH_DTYPES = ("float32", "bfloat16")  # bf16 runs under torch.autocast (channels_last for CNNs), as users run it
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"  # read by oneDNN at its first primitive, not at import
AMX_FREE_ISA = "AVX512_CORE_FP16"  # Sapphire Rapids' instructions less AMX: avx512_bf16 and avx512_fp16 stay
_AMX_PROBE = ("import torch\nx = torch.ones(64, 64)\n"
              "with torch.autocast('cpu', torch.bfloat16):\n    (x @ x).sum()")


@functools.cache
def avoid_broken_onednn_amx() -> bool:
    """Cap oneDNN (PyTorch's CPU kernels) below AMX in this process where its AMX path dies; True if capped.

    Some VMs show AMX in the CPU flags but report no tile palette (CPUID leaf 0x1D is zeros): oneDNN configures
    tiles of zero rows from it and PyTorch's first bf16 matmul dies of SIGILL, taking the process with it.
    relay_amp's kernels use the architectural palette and run there. A child process tries one bf16 matmul;
    call this before the first torch op (oneDNN fixes its ISA then). An ISA set by the user is left alone.
    """
    if not host_supports("amx_tile") or ONEDNN_ISA_ENV in os.environ:
        return False
    probe = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, timeout=600, check=False)
    if probe.returncode == 0:
        return False
    os.environ[ONEDNN_ISA_ENV] = AMX_FREE_ISA
    warnings.warn(f"PyTorch's AMX kernels die on this CPU (exit status {probe.returncode}; a VM reporting no AMX "
                  f"tile palette?): {ONEDNN_ISA_ENV}={AMX_FREE_ISA} for this process, so PyTorch runs AVX-512",
                  stacklevel=2)
    return True


def load_torch():
    """The torch module, imported with oneDNN kept off broken AMX; MissingDependencyError without torch."""
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        raise MissingDependencyError("PyTorch columns need torch: pip install -e '.[torch]'") from err
    avoid_broken_onednn_amx()
    return torch


def _resnet18(torch, classes: int = 1000):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                                      nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    stages, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        stages += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def _bert(torch, hidden: int = 256, heads: int = 4, layers: int = 4, vocab: int = 1000):
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True)
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return nn.Sequential(nn.Embedding(vocab, hidden), nn.LayerNorm(hidden), encoder)


def twin(name: str, batch: int = 1):
    """The PyTorch twin of built-in model `name` in eval mode, and an input for it."""
    torch = load_torch()
    nn = torch.nn
    builders = {
        "matmul": lambda: (nn.Linear(1024, 1024, bias=False), torch.randn(batch * 1024, 1024)),
        "resnet18_conv": lambda: (nn.Sequential(nn.Conv2d(128, 128, 3, 1, 1, bias=False), nn.ReLU()),
                                  torch.randn(batch, 128, 28, 28)),
        "resnet18": lambda: (_resnet18(torch), torch.randn(batch, 3, 224, 224)),
        "bert": lambda: (_bert(torch), torch.randint(0, 1000, (batch, 128))),
    }
    if name not in builders:
        raise OptionError(f"no PyTorch twin for model {name!r}; twins exist for {sorted(builders)}")
    module, example = builders[name]()
    return module.eval(), example


def channels_last(module, inputs: list) -> tuple:
    """`module` (converted in place) and its image `inputs` in channels_last: PyTorch's fastest bf16 CNN layout."""
    torch = load_torch()
    return (module.to(memory_format=torch.channels_last),
            [x.contiguous(memory_format=torch.channels_last) for x in inputs])


def best_twin(name: str, dtype: str, batch: int = 1):
    """The twin and its input laid out as PyTorch runs `dtype` fastest on CPU: channels_last for bf16 CNNs."""
    module, example = twin(name, batch)
    if dtype == "bfloat16" and example.dim() == 4:
        module, (example,) = channels_last(module, [example])
    return module, example


def twin_runner(name: str, dtype: str, threads: int, batch: int = 1) -> Callable[[], object]:
    """A call that runs the PyTorch twin of `name` once in `dtype` (bf16 under autocast) on `threads` CPU threads."""
    if dtype not in TORCH_DTYPES:
        raise OptionError(f"PyTorch timing supports {TORCH_DTYPES}, not {dtype!r}")
    torch = load_torch()
    torch.set_num_threads(threads)
    module, example = best_twin(name, dtype, batch)

    def run():
        with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            return module(example)

    return run
