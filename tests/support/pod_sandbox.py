"""Run a process the way kubelet runs a rendered container, on this machine: a read-only root filesystem, a fresh
tmpfs at each emptyDir mount, read-only binds for the pod's other volumes, the container's env (downward-API
fields resolved to given values) and nothing else of ours, as the pod's runAsUser/runAsGroup/fsGroup, a uid with
no passwd entry, inside a memory cgroup of the container's memory limit (`memory_cgroup`). Needs root (mount
namespaces, cgroups), `unshare`, `chroot`, `setpriv` and overlayfs; `require()` skips (fails under CI=true)
without them.

How: in a private mount namespace, an overlay whose lower layer is this machine's root (its upper layer a tmpfs, so
the mount points the pod needs are made there and the real root is never written) becomes the new root; /proc,
/sys and /dev come in, the pod's volumes are mounted, the overlay is remounted read-only, and the command runs
chrooted, with no capabilities and no_new_privs. NOTE: /root is 0700 here and this machine's interpreters live
under it (pyenv); in the sandbox only, /root is made traversable (0711), as an image's Python is runnable by any
uid.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.components import missing

IMAGE_PATH = "/usr/local/bin:/usr/bin:/bin"
CGROUP_ROOT = Path("/sys/fs/cgroup")
_SEQ = itertools.count()


def require() -> None:
    if os.geteuid() != 0:
        missing("root (the pod sandbox mounts filesystems in its own mount namespace)")
    for tool in ("unshare", "chroot", "setpriv"):
        if shutil.which(tool) is None:
            missing(tool)
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        missing(f"mount namespaces (unshare -m: {probe.stderr.decode(errors='replace').strip()})")


@dataclass
class Pod:
    """What the sandbox needs of a rendered pod: its container, pod securityContext and volumes."""

    container: Mapping
    pod_spec: Mapping
    field_values: Mapping[str, str] = field(default_factory=dict)  # fieldPath -> value (status.podIP, metadata.name)
    volume_sources: Mapping[str, str] = field(default_factory=dict)  # non-emptyDir volume name -> local directory

    def env(self) -> dict[str, str]:
        out = {"PATH": IMAGE_PATH}
        for e in self.container.get("env", []):
            if "value" in e:
                out[e["name"]] = e["value"]
            elif "fieldRef" in e.get("valueFrom", {}):
                out[e["name"]] = self.field_values[e["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                raise ValueError(f"env {e['name']}: no value for {e['valueFrom']} in the sandbox")
        return out

    def mounts(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(emptyDir mount paths, [(local directory, mount path)] of read-only binds)."""
        volumes = {v["name"]: v for v in self.pod_spec.get("volumes", [])}
        empty, binds = [], []
        for m in self.container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "emptyDir" in v:
                assert not m.get("readOnly"), m
                empty.append(m["mountPath"])
            elif m["name"] in self.volume_sources:
                binds.append((self.volume_sources[m["name"]], m["mountPath"]))
            else:
                raise ValueError(f"volume {m['name']} ({sorted(v)}): give its local directory (volume_sources)")
        return empty, binds


@dataclass(frozen=True)
class MemoryCgroup:
    """A memory cgroup (v1 or v2) under this process's own, holding the sandbox at the container's limit."""

    path: Path
    v2: bool

    def peak(self) -> int:
        """The most memory the cgroup held (bytes)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit (memory.events v2, memory.oom_control v1)."""
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill "))


def _own_memory_cgroup() -> tuple[Path, bool]:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/"), False
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            return CGROUP_ROOT / path.lstrip("/"), True
    raise RuntimeError("no memory cgroup")


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[MemoryCgroup]:
    """A child memory cgroup limited to `limit_bytes` (and no swap beyond it), removed once empty afterwards."""
    own, v2 = _own_memory_cgroup()
    path = own / f"pdfleet-pod-{os.getpid()}-{next(_SEQ)}"
    path.mkdir()
    try:
        (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))
        swap = path / ("memory.swap.max" if v2 else "memory.memsw.limit_in_bytes")
        if swap.exists():
            swap.write_text("0" if v2 else str(limit_bytes))
        yield MemoryCgroup(path, v2)
    finally:
        for _ in range(100):  # the processes it held are being reaped
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def command(pod: Pod, argv: Sequence[str], scratch: Path, cgroup: MemoryCgroup | None = None) -> list[str]:
    """The command line that runs `argv` in the sandbox (scratch: an empty directory of the host for the overlay;
    cgroup: the memory cgroup it runs in)."""
    sc = {**pod.pod_spec.get("securityContext", {}), **pod.container.get("securityContext", {})}
    assert sc.get("readOnlyRootFilesystem") is True, "the sandbox runs read-only roots only"
    uid, gid = int(sc["runAsUser"]), int(sc.get("runAsGroup", sc["runAsUser"]))
    groups = ",".join(str(g) for g in {gid, int(sc.get("fsGroup", gid))})
    root, layer = scratch / "root", scratch / "layer"
    root.mkdir(parents=True)
    layer.mkdir()
    empty, binds = pod.mounts()
    q = shlex.quote
    steps = [f"echo $$ > {q(str(cgroup.path / 'cgroup.procs'))}"] if cgroup is not None else []
    steps += [
        f"mount -t tmpfs tmpfs {q(str(layer))}",
        f"mkdir {q(str(layer / 'u'))} {q(str(layer / 'w'))}",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={q(str(layer / 'u'))},"
        f"workdir={q(str(layer / 'w'))} {q(str(root))}",
        f"chmod 0711 {q(str(root / 'root'))}",
        f"mount -t proc proc {q(str(root / 'proc'))}",
        f"mount --rbind /sys {q(str(root / 'sys'))}",
        f"mount --rbind /dev {q(str(root / 'dev'))}",
    ]
    for path in empty:  # emptyDir: kubelet makes it 0777
        target = q(str(root) + path)
        steps += [f"mkdir -p {target}", f"mount -t tmpfs -o mode=1777 tmpfs {target}"]
    for src, path in binds:
        target = q(str(root) + path)
        steps += [f"mkdir -p {target}", f"mount --bind {q(src)} {target}", f"mount -o remount,bind,ro {target}"]
    steps.append(f"mount -o remount,ro {q(str(root))}")
    env = " ".join(q(f"{k}={v}") for k, v in pod.env().items())
    steps.append(
        f"exec chroot {q(str(root))} setpriv --reuid={uid} --regid={gid} --groups={groups} --no-new-privs "
        f"--inh-caps=-all --bounding-set=-all -- /usr/bin/env -i {env} {' '.join(q(a) for a in argv)}"
    )
    return ["unshare", "-m", "--propagation", "private", "sh", "-euc", " && ".join(steps)]
