"""sana2-convert: a sana2 training checkpoint (DCP folder) <-> the reference's formats and diffusers'.

    sana2-convert <dump>/checkpoint/step-<N> <output> [--format accelerate|pth|safetensors|diffusers|diffusers-lora|
                  diffusers-pipeline]
                  [--dtype float32|bfloat16|float16] [--ema] [--model-only] [--verify] [--overwrite]
                  [--max-shard-size 5GB] [--sana-processes N] [--single-param-group] [--merge-lora]
    sana2-convert --to-dcp <model.pth | pytorch_model_fsdp.bin | x.safetensors | safetensors or diffusers folder>
                  <step folder>

Runs in one process on CPU (no process group), for a checkpoint saved at any world size, with one
tensor in memory at a time. Everything is written under a temporary name beside the output
and renamed into place only when complete (and verified, with --verify); a failed conversion
leaves nothing behind.

Exit codes: 0 done; 2 the conversion was refused or failed for a reason stated in one line
(bad arguments, a missing, corrupt or unsupported input, an existing output, a full disk, a
--verify difference); 130 interrupted; 1 an internal error (with its traceback).
"""

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from sana2 import staging
from sana2.cli import DTYPE_HELP, USER_ERROR, dtype_name, torch_dtype
from sana2.config import ConfigError
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.diffusers import DiffusersFormatError, sana2_model
from sana2.formats.diffusers_folder import NULL_CAPTION_KEY
from sana2.formats.diffusers_folder import read_config as read_diffusers_config
from sana2.formats.full_model import read_full_checkpoint
from sana2.formats.tensors import CheckpointError
from sana2.models import ModelConfigError
from sana2.staging import human_bytes
from sana2.tools.dcp_import import write_dcp
from sana2.tools.export import (
    LORA_WEIGHTS_NAME,
    SAFETENSORS_SOURCE,
    ExportPlan,
    diffusers_folder_config,
    export_accelerate,
    export_bytes,
    export_diffusers,
    export_pth,
    export_safetensors,
    latest_link,
    plan_export,
)
from sana2.tools.pipeline_export import PipelineParts, export_pipeline, pipeline_parts
from sana2.tools.sana_layout import SanaLayoutError, sana_epoch
from sana2.tools.verify import (
    VerificationFailed,
    verify_accelerate,
    verify_dcp,
    verify_diffusers,
    verify_pth,
    verify_safetensors,
)

DEFAULT_MAX_SHARD_SIZE = "5GB"
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class ConversionError(Exception):
    """A problem with the command line or the output location (one line for the user)."""


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not match:
        raise ConversionError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2) or ""])


# -- output locations -------------------------------------------------------------------------
OUTPUT_KIND = "sana2-convert"


def _is_own_file(path: Path) -> bool:
    """Whether an existing file is a model file this converter wrote: a safetensors file carrying its
    metadata, or a torch.save file holding nothing but {"state_dict": ...} (what it writes)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as handle:
                return (handle.metadata() or {}).get("source") == SAFETENSORS_SOURCE
        return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True)) == ["state_dict"]
    except Exception:  # not a file either library reads: not ours
        return False


def claim(path: Path, kind: str, inputs: list[Path], overwrite: bool) -> None:
    """--overwrite may replace only this converter's earlier output of the same kind; never an input
    or anything inside it (sana2.staging.claim_output)."""
    if kind == "link":  # a pointer: it moves to the newest export, as Sana's moves to its newest save
        staging.claim_output(path, f"{OUTPUT_KIND} latest pointer", inputs, folder=False, is_own=Path.is_symlink)
        return
    staging.claim_output(
        path,
        f"{OUTPUT_KIND} {kind}",
        inputs,
        folder=kind != "file",
        replace=overwrite,
        is_own=_is_own_file if kind == "file" else None,
        hint="pass --overwrite to replace it",
    )


class StagedOutputs:
    """Several outputs staged by sana2.staging and published together once all are written.

    A conversion that stops early (error, full disk, Ctrl-C) removes its temporaries and the
    folders it created for them; a killed one leaves only hidden `.<name>.partial-<pid>` names,
    never a valid-looking output. Each folder output is marked as this converter's (replaceable by
    a later --overwrite); nothing else is ever replaced.
    """

    def __init__(self, finals: dict[Path, str], overwrite: bool, source: Path, inputs: list[Path] = ()):
        # final path -> kind ("file", "accelerate", "safetensors", "diffusers", "dcp", "link", ...), in publishing
        # order; `inputs`: what the conversion reads besides `source` (a pipeline's VAE and text encoder)
        self.finals = finals
        for path, kind in finals.items():
            claim(path, kind, [source, *inputs], overwrite)
        self.temps = {path: staging.temporary_sibling(path) for path in finals}
        self.created: list[Path] = []  # parent folders made for the outputs, outermost first

    def __getitem__(self, final: Path) -> Path:
        return self.temps[final]

    def __enter__(self):
        for temp in self.temps.values():
            missing = [parent for parent in reversed(temp.parents) if not parent.exists()]
            temp.parent.mkdir(parents=True, exist_ok=True)
            self.created += [parent for parent in missing if parent not in self.created]
            staging.remove(temp)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            for temp in self.temps.values():
                staging.remove(temp)
            for parent in reversed(self.created):
                if parent.is_dir() and not any(parent.iterdir()):
                    parent.rmdir()
        return False

    def commit(self) -> None:
        """Publish every output; if one cannot be, those already published are removed again, so a
        failed conversion leaves none of its outputs (an --overwrite'd previous one is gone either way)."""
        published = []
        try:
            for final, temp in self.temps.items():
                if temp.is_dir() and not temp.is_symlink():
                    staging.mark_output(temp, f"{OUTPUT_KIND} {self.finals[final]}")
                staging.publish(temp, final, replace=True)
                published.append(final)
        except BaseException:
            for final in published:
                staging.remove(final)
            raise


# -- DCP -> files -----------------------------------------------------------------------------
def export(args) -> str:
    output = Path(args.output)
    single_safetensors = args.format in ("safetensors", "diffusers-lora") and output.suffix == ".safetensors"
    if single_safetensors and args.max_shard_size is not None:
        raise ConversionError("a .safetensors output is a single file; give a folder to write shards")
    max_shard_bytes = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    if args.format != "accelerate" and (args.sana_processes is not None or args.single_param_group):
        raise ConversionError("--sana-processes and --single-param-group apply to --format accelerate")
    if args.sana_processes is not None and args.sana_processes < 1:
        raise ConversionError(f"--sana-processes {args.sana_processes}: expected a number of processes, 1 or more")
    if args.format == "diffusers-lora" and args.merge_lora:
        raise ConversionError("--format diffusers-lora writes the adapters, --merge-lora the merged model: pass one")
    source = DcpCheckpoint(args.source)
    plan = plan_export(
        source,
        args.ema,
        torch_dtype(args.dtype) if args.dtype else None,
        args.model_only,
        args.sana_processes,
        not args.single_param_group,
        args.merge_lora,
        lora_adapters=args.format == "diffusers-lora",
    )
    config = diffusers_folder_config(plan) if args.format in ("diffusers", "diffusers-pipeline") else None
    parts = pipeline_parts(source, config) if args.format == "diffusers-pipeline" else None
    finals = _export_targets(args.format, output, plan, single_safetensors)
    staged = StagedOutputs(finals, args.overwrite, Path(args.source), parts.inputs if parts else [])
    needed = export_bytes(plan, args.format) + (parts.copied_bytes if parts else 0)
    staging.ensure_free_space(output, needed)
    started = time.monotonic()
    with staging.reporting_full_disk(output, needed), staged:
        report = _write_export(plan, args, staged, list(finals), single_safetensors, max_shard_bytes, config, parts)
        staged.commit()
    written = ", ".join(str(path) for path in finals)
    what = f"{len(plan.weights)} {plan.weights_from} tensors ({human_bytes(sum(w.nbytes for w in plan.weights))})"
    lines = [report, f"wrote {written}: {what} in {time.monotonic() - started:.1f} s"]
    if args.format == "accelerate" and not plan.model_only:
        lines.append(_resume_note(plan))
    if config is not None:
        lines += _diffusers_notes(config)
    if args.format == "diffusers-lora":
        base = plan.run_config.get("checkpoint", {}).get("initial_load_path")
        lines.append(
            f"note: alpha / rank is folded into lora_B; load it with SanaPipeline.load_lora_weights({str(output)!r}) "
            f"on a pipeline of the run's base ({base})"
        )
    return "\n".join(filter(None, lines))


def _resume_note(plan: ExportPlan) -> str:
    if plan.optimizer is None:
        return "note: the checkpoint holds no optimizer state, so there is no optimizer.bin or scheduler.bin"
    groups = len(plan.optimizer["param_groups"])
    return (
        f"Sana resumes it in epoch {sana_epoch(plan.epoch)} at step {plan.global_step} (micro-batches), with "
        f"{groups} param group{'s' * (groups > 1)} and a schedule for {plan.processes} process"
        f"{'es' * (plan.processes > 1)} (--sana-processes)"
    )


def _diffusers_notes(config: dict) -> list[str]:
    notes = [
        "note: diffusers holds no pos_embed (computed by the model) and no null caption (sana2 keeps it in "
        "sana2_null_caption.safetensors, which diffusers ignores; its pipelines encode the empty prompt instead)"
    ]
    if config.get("qk_norm"):
        notes.append(
            "note: diffusers builds the cross-attention q/k RMSNorm with eps 1e-5 where Sana uses 1e-6, so its "
            "outputs differ from sana2's by about 1e-3 (the other weights and options carry over exactly)"
        )
    return notes


def _export_targets(form: str, output: Path, plan: ExportPlan, single_safetensors: bool) -> dict[Path, str]:
    """Final path -> kind of each output the export creates, in the order they are published."""
    if form == "accelerate":
        if output.exists() and not output.is_dir():
            raise ConversionError(f"output {output} is a file; --format accelerate writes into a folder")
        targets = {output / plan.folder_name: "accelerate", output / f"{plan.folder_name}.pth": "file"}
        link = latest_link(plan)
        if link is not None:
            targets[output / link[0]] = "link"  # after the folder it points to
        return targets
    if form == "diffusers-pipeline":
        return {output: form}
    if form in ("diffusers", "diffusers-lora"):
        return {output: "file" if single_safetensors else form}
    return {output: "file" if form == "pth" or single_safetensors else "safetensors"}


def _write_export(
    plan: ExportPlan,
    args,
    staged: StagedOutputs,
    finals: list[Path],
    single_safetensors: bool,
    max_shard_bytes: int,
    config: dict | None,
    parts: PipelineParts | None = None,
) -> str:
    """Write the export to its temporary names; return the --verify summary (or "")."""
    if args.format == "accelerate":
        folder, pth = staged[finals[0]], staged[finals[1]]
        export_accelerate(plan, folder, pth, staged[finals[2]] if len(finals) > 2 else None)
        return verify_accelerate(plan, folder, pth) if args.verify else ""
    target = staged[finals[0]]
    if args.format == "diffusers":
        export_diffusers(plan, target, config, max_shard_bytes)
        return verify_diffusers(plan, target, config) if args.verify else ""
    if args.format == "diffusers-pipeline":  # --verify re-reads the transformer; the other parts are copies
        export_pipeline(plan, target, config, parts, max_shard_bytes)
        return verify_diffusers(plan, target / "transformer", config) if args.verify else ""
    if args.format == "diffusers-lora":
        path = target if single_safetensors else target / LORA_WEIGHTS_NAME
        export_safetensors(plan, path, True, max_shard_bytes, folder=not single_safetensors)
        return verify_safetensors(plan, path) if args.verify else ""
    if args.format == "pth":
        export_pth(plan, target)
        return verify_pth(plan, target) if args.verify else ""
    export_safetensors(plan, target, single_safetensors, max_shard_bytes)
    return verify_safetensors(plan, target) if args.verify else ""


# -- file -> DCP ------------------------------------------------------------------------------
def import_to_dcp(args) -> str:
    for flag, value in (
        ("--format", args.format != "accelerate"),
        ("--ema", args.ema),
        ("--model-only", args.model_only),
        ("--max-shard-size", args.max_shard_size),
        ("--sana-processes", args.sana_processes is not None),
        ("--single-param-group", args.single_param_group),
        ("--merge-lora", args.merge_lora),
    ):
        if value:
            raise ConversionError(f"{flag} applies to DCP -> file conversion, not --to-dcp")
    source, output = Path(args.source), Path(args.output)
    tensors = [tensor.to(torch_dtype(args.dtype)) if args.dtype else tensor for tensor in read_full_checkpoint(source)]
    run_config = {"converted_from": str(source)}
    diffusers = read_diffusers_config(source) if source.is_dir() else None
    if diffusers is not None:  # the model it describes, for whoever builds one to load the folder into
        name, kwargs = sana2_model(diffusers)
        null = [tensor for tensor in tensors if tensor.name == NULL_CAPTION_KEY]
        if null:  # the caption length the model was trained with, which diffusers' config does not hold
            kwargs["model_max_length"] = null[0].shape[0]
        run_config["model"] = {"name": name, **kwargs}
    staged = StagedOutputs({output: "dcp"}, args.overwrite, source)
    needed = sum(tensor.nbytes for tensor in tensors)
    staging.ensure_free_space(output, needed)
    started = time.monotonic()
    with staging.reporting_full_disk(output, needed), staged:
        write_dcp(tensors, staged[output], run_config)
        report = verify_dcp(tensors, staged[output]) if args.verify else ""
        staged.commit()
    summary = (
        f"wrote DCP checkpoint {output}: {len(tensors)} tensors ({human_bytes(needed)}) in "
        f"{time.monotonic() - started:.1f} s"
    )
    return "\n".join(filter(None, [report, summary]))


# -- command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sana2-convert",
        description="Convert a sana2 DCP training checkpoint (<dump>/checkpoint/step-<N>) to the reference's "
        "files, or (--to-dcp) a single-file model checkpoint to a DCP folder.",
        epilog="exit codes: 0 done; 2 refused or failed for a reason stated in one line (bad arguments, a "
        "missing, corrupt or unsupported input, an existing output, a full disk, a --verify difference), "
        "with nothing left behind; 130 interrupted; 1 internal error",
    )
    parser.add_argument(
        "source",
        help="DCP step folder (or, with --to-dcp, a .pth/.bin/.safetensors file, a safetensors folder or a "
        "diffusers transformer folder)",
    )
    parser.add_argument(
        "output",
        help="accelerate: folder receiving epoch_<E>_step_<S>/, epoch_<E>_step_<S>.pth and latest.pth; "
        "pth: the file; safetensors: a .safetensors file, or a folder "
        "(model.safetensors, or an index and shards); diffusers: the model folder; diffusers-lora (a LoRA "
        "run's adapters for SanaPipeline.load_lora_weights): a .safetensors file, or a folder receiving "
        f"{LORA_WEIGHTS_NAME}; diffusers-pipeline: the folder SanaPipeline.from_pretrained loads (the run's "
        "VAE, text encoder and sampler beside the model); "
        "--to-dcp: the step folder",
    )
    parser.add_argument(
        "--format",
        choices=("accelerate", "pth", "safetensors", "diffusers", "diffusers-lora", "diffusers-pipeline"),
        default="accelerate",
    )
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        choices=("float32", "bfloat16", "float16"),
        help=f"dtype of the exported floating-point weights, {DTYPE_HELP} (default: as saved; optimizer states "
        "always stay as saved)",
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (buffers come from the model)")
    parser.add_argument(
        "--model-only", action="store_true", help="accelerate format: skip optimizer, scheduler and RNG files"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="re-read every written tensor and compare it with the source before committing",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--max-shard-size",
        help=f"safetensors folder or diffusers output: largest shard (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--sana-processes",
        type=int,
        help="accelerate format: processes of the Sana run that resumes (its scheduler steps once per "
        "process; default: the world size the checkpoint was saved at)",
    )
    parser.add_argument(
        "--single-param-group",
        action="store_true",
        help="accelerate format: one optimizer param group instead of Sana's one per parameter",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's step folder: export its base (checkpoint.initial_load_path) with the adapters merged "
        "in, as sana2-sample draws it (model weights only)",
    )
    parser.add_argument("--to-dcp", action="store_true", help="convert a full-model checkpoint to a DCP folder")
    return parser


def release_large_blocks_to_the_os() -> None:
    """Have glibc map blocks of 1 MB and more on their own and unmap them when freed.

    By default it raises that threshold as large blocks are freed and then keeps freed tensors'
    memory for reuse, so a stream of differently sized tensors can hold several times the
    largest one (measured: 300 -> 550 MB on a 640 MB checkpoint). Elsewhere this is a no-op.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # from malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 20)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    release_large_blocks_to_the_os()
    try:
        message = import_to_dcp(args) if args.to_dcp else export(args)
    except (
        CheckpointError,
        ConversionError,
        VerificationFailed,
        DiffusersFormatError,
        SanaLayoutError,
        ConfigError,
        staging.OutputRefused,
    ) as exc:
        return _fail(str(exc))
    except ModelConfigError as exc:  # the run config names a model sana2 cannot build
        return _fail(f"{args.source}: {exc}")
    except OSError as exc:  # full disk, permissions: the file and the reason, without a traceback
        return _fail(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted; temporary output removed", code=130)
    print(message)
    return 0


def _fail(message: str, code: int = USER_ERROR) -> int:
    print(f"sana2-convert: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
