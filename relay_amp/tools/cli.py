"""The relay-amp command line: inspect layers, convert models and build them into libraries from a shell."""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import tvm
from tabulate import tabulate

from .. import frontend
from .._ir import get_function, tensor_dtype, tensor_shape
from ..compile.build import build, export_library, library_path
from ..compile.tuning import RPC_WAIT_S, log_dir, tune
from ..errors import MissingDependencyError, OptionError, RelayAmpError, one_line
from ..passes.amp import PrecisionPlan, apply_plan, precision_plan, to_mixed_precision
from ..passes.layers import DEFAULT_LAYER_OPS, count_layers, list_layers
from ..passes.quantize import QuantPlan, apply_quant_plan, quant_plan, quantize, realize_qdq
from ..passes.quantize.observers import DEFAULT_PERCENTILE, OBSERVERS
from ..passes.recast import DEFAULT_RECAST_OPS, recast
from ..passes.shapes import specialize
from ..serialization import atomic_write_text, load, save
from ..targets import host_cores, host_preset
from . import models
from .bench import BASELINE, LAYOUTS, QUANTIZED, benchmark, format_rows, logs_for, rows_to_json, variant
from .calibration import load_batches, random_batches
from .gpu_check import MODELS as GPU_MODELS
from .gpu_check import VARIANTS as GPU_VARIANTS
from .gpu_check import format_rows as format_gpu_rows
from .gpu_check import gpu_check
from .profile import format_profile, profile, profile_to_json

SAVED_SUFFIX = ".json"  # a module written by save (convert's and quantize's -o)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8", "int8q": "int8q", "int4w": "int4w"}


def load_model(spec: str, batch: int = 1, dims: "dict[str, int] | None" = None) -> tvm.IRModule:
    """A built-in model by name (see relay_amp.models.MODELS), a module saved by convert or quantize (.json) or an
    ONNX file by path, its symbolic input dims named in `dims` bound to their sizes."""
    if spec in models.MODELS:
        if dims:
            raise OptionError(f"--dim sizes an ONNX file's symbolic dims; built-in model {spec!r} takes --batch")
        return models.get_model(spec, batch=batch)
    if Path(spec).suffix == SAVED_SUFFIX:
        return specialize(load(spec), dims) if dims else load(spec)
    return frontend.from_onnx(spec, dims=dims)


def layer_table(mod: tvm.IRModule, ops: Sequence[str]) -> str:
    """The layer index of `mod` as a printable table."""
    rows = [
        (l.index, l.op.removeprefix("relax."), l.name, " x ".join(map(str, l.input_shapes)),
         ",".join(l.input_dtypes), l.output_shape, l.output_dtype)
        for l in list_layers(mod, ops)
    ]
    headers = ("index", "op", "name", "input shapes", "input dtypes", "output shape", "output dtype")
    return tabulate(rows, headers=headers)


def _cmd_layers(args: argparse.Namespace) -> None:
    mod = load_model(args.model, args.batch, args.dim)
    print(layer_table(mod, args.ops))
    print(f"\n{count_layers(mod, args.ops)} layers, longest chain {count_layers(mod, args.ops, depth=True)}")


def _cmd_recast(args: argparse.Namespace) -> None:
    mod = recast(load_model(args.model, args.batch, args.dim), args.dtype, args.out_dtype, args.ops, args.skip)
    print(layer_table(mod, args.ops))
    _write_text(args.output, mod.script(show_meta=True))


def _write_text(path: str | None, text: str) -> None:
    if path is None:
        return
    atomic_write_text(path, text)
    print(f"wrote {path}")


def _cmd_convert(args: argparse.Namespace) -> None:
    mod = load_model(args.model, args.batch, args.dim)
    if args.apply_plan:
        converted = apply_plan(mod, PrecisionPlan.load(args.apply_plan))
    else:
        overrides = {"fp32_ops": args.fp32_ops, "target_dtype_ops": args.target_ops}
        converted = to_mixed_precision(
            mod, args.dtype, excluded_layers=args.exclude, keep_io_types=not args.low_io,
            **{key: ops for key, ops in overrides.items() if ops is not None},
        )
    plan = precision_plan(converted)
    print(layer_table(converted, DEFAULT_LAYER_OPS))
    print()
    print(plan.summary())
    _write_plan_and_module(args, plan, converted)


def _write_plan_and_module(args: argparse.Namespace, plan, mod: tvm.IRModule) -> None:
    """Save the plan to --plan and the module to -o/--output, where given."""
    if args.plan:
        plan.save(args.plan)
        print(f"wrote {args.plan}")
    if args.output:
        save(mod, args.output)
        print(f"wrote {args.output}")


def _cmd_build(args: argparse.Namespace) -> None:
    library_path(args.output)  # bad options fail before the build
    if args.calib and args.dtype != QUANTIZED:
        raise OptionError(f"--calib calibrates --dtype int8q, not {args.dtype or 'a model built as given'}")
    mod = load_model(args.model, args.batch, args.dim)
    if args.dtype == QUANTIZED and not args.calib:
        print("int8q calibrated on random inputs: give --calib DATA.npz of real ones for a model to ship")
    calibration = load_batches(mod, args.calib) if args.calib else None
    converted = mod if args.dtype is None else variant(mod, args.dtype, calibration)
    logs = logs_for(args.tune_logs, args.model, args.dtype or BASELINE, args.target)
    executable = build(converted, args.target, logs, not args.exact_math, LAYOUTS[args.layout])
    path = export_library(executable, args.output)
    print(f"wrote {path} ({_size_text(path.stat().st_size)}) for {args.target}; run it with the TVM runtime alone: "
          f"relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())[\"main\"]({_input_text(converted)})")


def _input_text(mod: tvm.IRModule) -> str:
    """main's parameters as `name: dtype[shape]`, comma-separated (what the library's main takes, in order)."""
    return ", ".join(f"{param.name}: {tensor_dtype(param)}{list(tensor_shape(param) or ['?'])}"
                     for param in get_function(mod, "main").params)


def _size_text(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"


def _cmd_tune(args: argparse.Namespace) -> None:
    mod = variant(load_model(args.model, args.batch, args.dim), args.dtype)
    work_dir = args.work_dir or log_dir("tune_logs", args.model, args.dtype, args.target)
    description = {"model": args.model, "batch": args.batch, "dtype": args.dtype}
    tune(mod, args.target, work_dir, args.trials, trials_per_task=args.trials_per_task,
         trials_per_iter=args.trials_per_iter, description=description, rpc_tracker=args.rpc_tracker,
         rpc_key=args.rpc_key, rpc_wait_s=args.rpc_wait)
    print(f"wrote tuning records to {work_dir}")


ZOO_PREFIX = "zoo"


def _cmd_quantize(args: argparse.Namespace) -> None:
    mod = load_model(args.model, args.batch, args.dim)
    if args.from_qdq:
        _require_unset(args, "--from-qdq", calib=None, apply_plan=None, exclude=[], dynamic_matmuls=False,
                       float_residuals=False, separate_ranges=False, activation_bits="auto",
                       no_bias_correction=False)
        quantized = realize_qdq(mod, fallback_dtype=args.fallback)
    elif args.apply_plan:
        quantized = apply_quant_plan(mod, QuantPlan.load(args.apply_plan))
    else:
        batches = load_batches(mod, args.calib) if args.calib else random_batches(mod)
        quantized = quantize(mod, batches, observer=args.observer, percentile=args.percentile,
                             excluded_layers=args.exclude, fallback_dtype=args.fallback,
                             dynamic_matmuls=args.dynamic_matmuls, quantized_residuals=not args.float_residuals,
                             shared_ranges=not args.separate_ranges, activation_bits=args.activation_bits,
                             bias_correction=not args.no_bias_correction)
    plan = quant_plan(quantized)
    print(plan.summary())
    _write_plan_and_module(args, plan, quantized)


def _require_unset(args: argparse.Namespace, flag: str, **defaults) -> None:
    """OptionError naming the first of `defaults`' options given beside `flag`, which ignores them."""
    for name, default in defaults.items():
        if getattr(args, name) != default:
            raise OptionError(f"--{name.replace('_', '-')} does not apply with {flag}")


def _cmd_bench(args: argparse.Namespace) -> None:
    if args.model == ZOO_PREFIX or args.model.startswith(ZOO_PREFIX + ":"):
        _bench_zoo(args)
        return
    if args.ort and args.model in models.MODELS:
        raise OptionError(f"--ort times ONNX Runtime on an ONNX file; {args.model!r} is a built-in model")
    mod = load_model(args.model, args.batch, args.dim)
    twin = args.model if args.torch else None
    rows = benchmark(mod, args.dtypes, args.target, args.tune_logs, args.model, args.repeat, layout=args.layout,
                     torch_twin=twin, onnx_file=args.model if args.ort else None,
                     calibration=load_batches(mod, args.calib) if args.calib else None, rounds=args.rounds,
                     fast_math=not args.exact_math)
    if args.json:
        print(rows_to_json(rows, model=args.model, batch=args.batch, target=args.target, repeat=args.repeat,
                           rounds=args.rounds, layout=args.layout, threads=host_cores()))
    else:
        print(f"{args.model} (batch {args.batch}) on {args.target}, {host_cores()} threads, median of "
              f"{args.rounds} rotating rounds of {args.repeat} runs, conv layout {args.layout}")
        print(f"tuning logs: {args.tune_logs or 'none'}\n")
        print(format_rows(rows))


def _cmd_profile(args: argparse.Namespace) -> None:
    if args.model.partition(":")[0] == ZOO_PREFIX:
        rows = _profile_zoo(args)
    else:
        rows = profile(load_model(args.model, args.batch, args.dim), args.dtypes, args.target, args.repeat,
                       conv_layout=LAYOUTS[args.layout], by_shape=args.by_shape)
    if args.json:
        print(profile_to_json(rows, model=args.model, batch=args.batch, target=args.target, dtypes=args.dtypes))
    else:
        print(f"{args.model} (batch {args.batch}) on {args.target}: ms per inference of each call group, "
              f"median of {args.repeat} runs, worst {args.dtypes[-1]} penalty first\n")
        print(format_profile(rows, args.dtypes, args.top))


def _zoo_modules(command: str):
    """The zoo and its benchmark (torch, transformers, onnxruntime: the zoo extra), or an error saying so."""
    try:
        from . import zoo, zoo_bench
    except ImportError as err:
        raise MissingDependencyError(f"{command} zoo needs the zoo extra (pip install -e '.[zoo]'): {err}") from err
    return zoo, zoo_bench


def _profile_zoo(args: argparse.Namespace) -> list:
    """`profile zoo:NAME`: one zoo model profiled as the zoo bench builds it (its export, inputs, calibration)."""
    zoo, zoo_bench = _zoo_modules("profile")
    if args.dim or args.batch != 1:
        raise OptionError("profile zoo:NAME profiles the zoo model at its zoo size: --batch and --dim do not apply")
    return zoo_bench.profile_model(zoo.entry(args.model.partition(":")[2]).name, args.dtypes, args.target,
                                   args.repeat, by_shape=args.by_shape, conv_layout=LAYOUTS[args.layout])


def _bench_zoo(args: argparse.Namespace) -> None:
    zoo, zoo_bench = _zoo_modules("bench")
    names = _op_list(args.model.partition(":")[2]) or list(zoo.ZOO)
    for name in names:
        zoo.entry(name)  # an unknown name fails before any model is built
    dtypes = [d for d in args.dtypes if d != "float32"]
    print(f"zoo on {args.target}, {host_cores()} threads, {args.rounds} rounds of {args.repeat} runs; "
          f"results to {args.results}")
    results = zoo_bench.bench_zoo(names, dtypes, args.target, args.results, rounds=args.rounds, repeat=args.repeat,
                                  torch_compile=args.torch_compile,
                                  progress=lambda result: print(zoo_bench.markdown_table([result]), flush=True))
    print(f"wrote {args.results}/zoo.json, zoo.md and zoo.png")
    failed = zoo_bench.failures(results)
    if failed:
        raise RelayAmpError(failed)


def _target(text: str) -> str:
    return host_preset() if text == "auto" else text


def _dtype_list(text: str) -> list[str]:
    return [_dtype(part) for part in _op_list(text)]


def _auto_or_int(text: str) -> "str | int":
    """ "auto", or the integer `text` spells (argparse's choices then check it)."""
    return text if text == "auto" or not text.lstrip("-").isdigit() else int(text)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _dims(text: str) -> dict[str, int]:
    """NAME=SIZE[,NAME=SIZE...] as {name: size}."""
    try:
        return {name.strip(): int(size) for name, size in (part.split("=") for part in _op_list(text))}
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE[,NAME=SIZE...], e.g. batch=1; got {text!r}") from err


def _op_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def _command(commands, name: str, help_text: str, run, ops: Sequence[str] | None = None,
             target: bool = False) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help_text)
    parser.add_argument("model", help=f"built-in model ({', '.join(models.MODELS)}), ONNX file, module saved by "
                        "convert or quantize (.json), or (bench) zoo[:NAMES], (profile) zoo:NAME")
    parser.add_argument("--batch", type=int, default=1, help="batch size of a built-in model")
    parser.add_argument("--dim", type=_dims, default={}, help="sizes of an ONNX file's symbolic input dims "
                        "(dynamic axes), e.g. batch=1,sequence=128: the kernels need static shapes")
    if ops is not None:
        parser.add_argument("--ops", type=_op_list, default=list(ops), help="comma-separated op names")
    if target:
        parser.add_argument("--target", type=_target, default="auto",
                            help="target preset (cpu, cpu-avx512-bf16, ...); auto picks the best this CPU runs")
    parser.set_defaults(run=run)
    return parser


def _cmd_gpu_check(args: argparse.Namespace) -> None:
    rows = gpu_check(args.models, args.variants, args.repeat, args.results)
    print(format_gpu_rows(rows))
    if args.results:
        print(f"wrote {args.results}/gpu_check.json and gpu_check.md")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the relay-amp command."""
    parser = argparse.ArgumentParser(prog="relay-amp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    _command(commands, "layers", "print the layer index of a model", _cmd_layers, ops=DEFAULT_LAYER_OPS)

    rc = _command(commands, "recast", "force ops to a dtype with a wider accumulator", _cmd_recast,
                  ops=DEFAULT_RECAST_OPS)
    rc.add_argument("--dtype", type=_dtype, default="int8", help="compute dtype of the chosen ops")
    rc.add_argument("--out-dtype", default="int32", help="accumulator dtype")
    rc.add_argument("--skip", type=_int_list, default=[], help="layer indices to leave alone, e.g. 0,-1")
    rc.add_argument("-o", "--output", help="write the converted module as TVMScript")

    cv = _command(commands, "convert", "automatic mixed precision with a precision plan", _cmd_convert)
    cv.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (bfloat16) or fp16 (float16)")
    cv.add_argument("--fp32-ops", type=_op_list, help="replace the fp32 list, e.g. nn.softmax,nn.layer_norm")
    cv.add_argument("--target-ops", type=_op_list, help="replace the always-low-precision list")
    cv.add_argument("--exclude", type=_int_list, default=[], help="layer indices kept in fp32, e.g. 0,3")
    cv.add_argument("--low-io", action="store_true", help="make inputs and outputs low precision too")
    cv.add_argument("--apply-plan", help="re-apply a saved (possibly edited) precision plan instead")
    cv.add_argument("--plan", help="write the precision plan as JSON")
    cv.add_argument("-o", "--output", help="write the converted module (TVM JSON, relay_amp.load reads it)")

    qz = _command(commands, "quantize", "calibrated int8 with a quantization plan (the rest in a fallback dtype)",
                  _cmd_quantize)
    qz.add_argument("--calib", help=".npz of calibration inputs: per model input (by name), samples along axis 0; "
                    "default: 8 random batches")
    qz.add_argument("--observer", choices=OBSERVERS, default="minmax", help="how activation ranges are chosen")
    qz.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE, help="for --observer percentile")
    qz.add_argument("--exclude", type=_int_list, default=[], help="layer indices left to the fallback dtype")
    qz.add_argument("--fallback", type=_dtype, default="bfloat16", help="dtype of everything not in int8")
    qz.add_argument("--dynamic-matmuls", action="store_true", help="matmuls scale activations per row at run time")
    qz.add_argument("--float-residuals", action="store_true", help="residual adds read their operands in floating "
                    "point (default: a uint8 operand's codes, as ONNX Runtime's QDQ models do)")
    qz.add_argument("--separate-ranges", action="store_true", help="each layer keeps its own calibrated range "
                    "(default: layers reading moves of one value, a concat's or split's, share one)")
    qz.add_argument("--activation-bits", type=_auto_or_int, choices=("auto", 7, 8), default="auto",
                    help="bits of the activation codes: 7 or 8 (auto: 7 for unsigned and per-row codes where the host "
                    "multiplies bytes on AVX2 alone, exact and faster there; else 8)")
    qz.add_argument("--no-bias-correction", action="store_true", help="leave the mean output error of the weights' "
                    "rounding in (default: each layer takes it out, from its input channels' calibration means)")
    qz.add_argument("--apply-plan", help="re-apply a saved (possibly edited) quantization plan instead")
    qz.add_argument("--from-qdq", action="store_true", help="the model is quantized already (ONNX Runtime's QDQ, "
                    "QOperator or dynamic int8 files): run it on relay_amp's int8 layers with its own ranges, no "
                    "calibration")
    qz.add_argument("--plan", help="write the quantization plan as JSON")
    qz.add_argument("-o", "--output", help="write the quantized module (TVM JSON, relay_amp.load reads it)")

    tn = _command(commands, "tune", "autotune a model with MetaSchedule (XGBoost cost model)", _cmd_tune,
                  target=True)
    tn.add_argument("--dtype", type=_dtype, default="float32", help="fp32, bf16 or fp16 (AMP defaults), or int8 (recast)")
    tn.add_argument("--trials", type=int, required=True, help="measurement trials over all operators")
    tn.add_argument("--trials-per-task", type=int, help="cap on the trials of one operator")
    tn.add_argument("--trials-per-iter", type=int, default=16, help="candidates measured per round and task")
    tn.add_argument("--work-dir", help="where the records go (default tune_logs/MODEL-DTYPE-TARGET); "
                    "a work dir that holds records resumes: only the missing trials are measured")
    tn.add_argument("--rpc-tracker", help="HOST:PORT of a TVM RPC tracker: measure on its servers")
    tn.add_argument("--rpc-key", help="the servers' key at the tracker (with --rpc-tracker)")
    tn.add_argument("--rpc-wait", type=float, default=RPC_WAIT_S, help="seconds to wait for a server of the key")

    bd = _command(commands, "build", "compile a model (converted first, where --dtype says) into a library the TVM "
                  "runtime loads", _cmd_build, target=True)
    bd.add_argument("--dtype", type=_dtype, help="fp32, bf16 or fp16 (AMP defaults), int8q (quantize), int8 (recast), "
                    "int4w; default: the model as given (e.g. a module saved by convert or quantize)")
    bd.add_argument("--calib", help="int8q: .npz of calibration inputs, as for quantize (default: random batches)")
    bd.add_argument("--tune-logs", help="a tuning log, or a root holding MODEL-DTYPE-TARGET logs")
    bd.add_argument("--layout", choices=list(LAYOUTS), default="auto", help="conv layout, as for bench")
    bd.add_argument("--exact-math", action="store_true", help="keep libm erf/exp (no relay_amp.backend.cpu.fastmath)")
    bd.add_argument("-o", "--output", required=True, help="the library to write: .so (shared) or .tar (objects)")

    bn = _command(commands, "bench", "build, time and check every dtype variant of a model", _cmd_bench,
                  target=True)
    bn.add_argument("--dtypes", type=_dtype_list, default=["float32", "bfloat16"], help="e.g. fp32,bf16,fp16,int8,int8q,int4w")
    bn.add_argument("--tune-logs", help="a tuning log, or a root holding MODEL-DTYPE-TARGET logs")
    bn.add_argument("--repeat", type=int, default=10, help="timed runs per variant in each round")
    bn.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bn.add_argument("--layout", choices=list(LAYOUTS), default="auto",
                    help="conv layout: the backend's choice (auto: NHWC on CPU), one to force, or the model's (keep)")
    bn.add_argument("--torch", action="store_true", help="add the PyTorch twin's fp32/bf16 times (needs torch)")
    bn.add_argument("--ort", action="store_true",
                    help="an ONNX file: add ONNX Runtime's rows on it (fp32; with int8q, its own int8 model of the file)")
    bn.add_argument("--exact-math", action="store_true", help="keep libm erf/exp (no relay_amp.backend.cpu.fastmath)")
    bn.add_argument("--calib", help="int8q (and ONNX Runtime's static int8): .npz of calibration inputs, as for "
                    "quantize (default: random batches)")
    bn.add_argument("--rounds", type=int, default=3, help="rotating rounds of --repeat runs per runner")
    bn.add_argument("--results", default="benchmarks/results", help="zoo: where zoo.json, zoo.md, zoo.png go")
    bn.add_argument("--torch-compile", action="store_true", help="zoo: also time torch.compile (slow to compile)")

    pf = _command(commands, "profile", "time every fused function and kernel call, dtype variants side by side",
                  _cmd_profile, target=True)
    pf.add_argument("--dtypes", type=_dtype_list, default=["float32", "bfloat16"], help="e.g. fp32,bf16")
    pf.add_argument("--repeat", type=int, default=5, help="timed runs per variant")
    pf.add_argument("--top", type=int, default=20, help="rows to print")
    pf.add_argument("--layout", choices=list(LAYOUTS), default="auto", help="conv layout, as for bench")
    pf.add_argument("--json", action="store_true", help="print JSON (every row) instead of a table")
    pf.add_argument("--by-shape", action="store_true",
                    help="one row per output shape of each call group (which of the kernels is slow)")

    gc = commands.add_parser("gpu-check", help="build, run and time the CUDA path on this machine's NVIDIA GPU")
    gc.add_argument("--models", type=_op_list, default=list(GPU_MODELS), help="built-in models, e.g. resnet18,bert")
    gc.add_argument("--variants", type=_op_list, default=list(GPU_VARIANTS), help="of float32,float16,int8,int4,int8q")
    gc.add_argument("--repeat", type=int, default=20, help="timed runs per variant")
    gc.add_argument("--results", help="write gpu_check.json and gpu_check.md into this directory")
    gc.set_defaults(run=_cmd_gpu_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the relay-amp console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (RelayAmpError, OSError) as err:
        print(f"relay-amp: error: {one_line(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
