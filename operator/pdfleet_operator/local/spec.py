"""What `pdfleet up` runs: the InferenceDeployment of a file, validated as admission validates it (and its engines as
the operator checks them, `decide.runtimes`), with its AcceleratorClasses, each pool's runtime and its model directory
on this machine."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pdfleet_operator import validate
from pdfleet_operator.api import AcceleratorClass, AcceleratorClassSpec, InferenceDeployment, InferenceDeploymentSpec
from pdfleet_operator.api.inference_deployment import ModelArchitecture
from pdfleet_operator.decide import runtimes

# The class a spec runs on when no --classes file is given: the `cpu` entry of
# examples/acceleratorclasses.yaml (tests/local checks that the two stay equal).
DEFAULT_CLASSES_YAML = """\
apiVersion: pdfleet.io/v1alpha1
kind: AcceleratorClass
metadata:
  name: cpu
spec:
  vendor: cpu
  model: 2 x86-64 cores
  resourceName: cpu
  count: 2
  memoryGiB: 8
  peakTflops: 0.7
  memoryBandwidthGBps: 24
  networkGBps: 5
  costPerHour: 0.10
  costSource: Indicative on-demand price of a 2-vCPU / 8 GiB cloud instance
  costAsOf: "2025-06-01"
"""


class UpError(Exception):
    """A reason `pdfleet up` cannot run, in one line; it exits non-zero with nothing left running."""


class SpecInvalid(UpError):
    """The spec (or classes) file breaks the API's rules: one `validate.Problem` per line, as admission words them."""

    def __init__(self, problems: list[validate.Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class LocalSpec:
    """A validated deployment ready to run here."""

    name: str
    namespace: str
    spec: InferenceDeploymentSpec  # with model.architecture filled in from config.json when absent
    classes: dict[str, AcceleratorClassSpec]
    model_dir: Path
    source: Path  # the spec file
    # (role, class) -> what that pool runs, for every class a role lists that is defined
    pools: dict[tuple[str, str], runtimes.PoolRuntime]

    def engine(self, role: str, accelerator_class: str) -> str:
        return self.pools[(role, accelerator_class)].name

    def engines(self) -> dict[str, list[str]]:
        """role -> the engines its pools run (what the metrics sources read each role with)."""
        out: dict[str, list[str]] = {}
        for (role, _), rt in sorted(self.pools.items()):
            if rt.name not in out.setdefault(role, []):
                out[role].append(rt.name)
        return out


def load(path: str | Path, classes_path: str | Path | None = None) -> LocalSpec:
    """Parse and check everything `pdfleet up` needs before it starts a process; UpError otherwise."""
    path = Path(path)
    docs = _documents(path)
    deployments = [(src, d) for src, d in docs if isinstance(d, dict) and d.get("kind") == "InferenceDeployment"]
    class_docs = [(src, d) for src, d in docs if isinstance(d, dict) and d.get("kind") == "AcceleratorClass"]
    others = [(src, d) for src, d in docs if (src, d) not in deployments and (src, d) not in class_docs]
    if classes_path is not None:
        extra = _documents(Path(classes_path))
        wrong = [src for src, d in extra if not (isinstance(d, dict) and d.get("kind") == "AcceleratorClass")]
        if wrong:
            raise UpError(f"{wrong[0]}: --classes takes AcceleratorClass objects only")
        class_docs += extra
    problems = [p for src, d in deployments + class_docs + others for p in validate.validate_object(d, src)]
    if problems:
        raise SpecInvalid(problems)
    if len(deployments) != 1:
        raise UpError(f"{path}: expected exactly one InferenceDeployment, found {len(deployments)}")
    dep = InferenceDeployment.model_validate(deployments[0][1])

    classes = {}
    if classes_path is None and not class_docs:
        class_docs = [("<built-in>", yaml.safe_load(DEFAULT_CLASSES_YAML))]
    for _, doc in class_docs:
        acc = AcceleratorClass.model_validate(doc)
        classes[acc.metadata.name] = acc.spec
    for role, rs in dep.spec.roles().items():
        missing = [c for c in rs.accelerator_classes if c not in classes]
        if len(missing) == len(rs.accelerator_classes):
            raise UpError(
                f"{path}: spec.{role}.acceleratorClasses: {', '.join(missing)} not defined "
                f"(known: {', '.join(sorted(classes))}); pass --classes FILE with their AcceleratorClasses"
            )
        if rs.min_replicas < 1:
            raise UpError(
                f"{path}: spec.{role}.minReplicas: 0 is not supported by `pdfleet up` "
                "(a pool at zero has no queue to scale it back up from); use 1 or more"
            )

    wrong = runtimes.check(dep.spec, classes)
    if wrong:  # as `pdfleet validate` and the operator word them
        raise SpecInvalid(
            [validate.Problem(str(path), f"InferenceDeployment/{dep.name}", p.field, p.message) for p in wrong]
        )
    pools = {
        (role, name): runtimes.for_pool(dep.spec, role, name, classes[name])
        for role, rs in dep.spec.roles().items()
        for name in rs.accelerator_classes
        if name in classes
    }

    model_dir = model_directory(dep.spec, path)
    spec = dep.spec
    if spec.model.architecture is None:
        model = spec.model.model_copy(update={"architecture": architecture(model_dir)})
        spec = spec.model_copy(update={"model": model})
    return LocalSpec(dep.name, dep.metadata.namespace or "default", spec, classes, model_dir, path, pools)


def _documents(path: Path) -> list[tuple[str, Any]]:
    if not path.exists():
        raise UpError(f"{path}: no such file")
    if path.is_dir():
        raise UpError(f"{path}: is a directory; give the InferenceDeployment's YAML file")
    try:
        docs = validate.load_documents(path)
    except ValueError as exc:  # not YAML at all: as `pdfleet validate` reports it
        raise SpecInvalid([validate.Problem(str(path), "?", "", str(exc).removeprefix(f"{path}: "))]) from None
    except OSError as exc:
        raise UpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not docs:
        raise UpError(f"{path}: no objects in the file")
    return docs


def model_directory(spec: InferenceDeploymentSpec, spec_file: Path) -> Path:
    """The weights on this machine: source.local (relative to the spec file) or source.hostPath."""
    src = spec.model.source
    if src.pvc is not None:
        raise UpError(
            f"{spec_file}: spec.model.source.pvc: a PersistentVolumeClaim cannot be read on this machine; "
            "use source.local.path (relative to the spec file) or source.hostPath.path"
        )
    if src.local is not None:
        where, field = spec_file.parent / src.local.path, "spec.model.source.local.path"
    else:
        assert src.host_path is not None, "validated model.source without pvc, hostPath or local"
        where, field = Path(src.host_path.path), "spec.model.source.hostPath.path"
    where = where.resolve()
    if not where.is_dir():
        hint = " (make one with `pdfleet model init DIR --preset tiny`)"
        raise UpError(f"{spec_file}: {field}: model directory {where} does not exist{hint}")
    for needed in ("config.json", "tokenizer.json"):
        if not (where / needed).is_file():
            raise UpError(f"{spec_file}: {field}: {where} has no {needed}: not a Hugging Face model directory")
    if not any(where.glob("*.safetensors")):
        raise UpError(f"{spec_file}: {field}: {where} has no *.safetensors weights")
    return where


def architecture(model_dir: Path) -> ModelArchitecture:
    """model.architecture from config.json and the safetensors headers (parameters counted, not guessed)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UpError(f"{model_dir / 'config.json'}: cannot read the model's shape: {exc}") from None
    params = sum(safetensors_parameters(p) for p in sorted(model_dir.glob("*.safetensors")))
    return ModelArchitecture(parameters_billions=params / 1e9, layers=layers, kv_heads=kv_heads, head_dim=head_dim)


def safetensors_parameters(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header (no tensor is loaded)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
        return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise UpError(f"{path}: not a readable safetensors file: {exc}") from None
