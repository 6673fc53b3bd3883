"""Run a process the way kubelet runs a rendered container, on this machine: a read-only root filesystem, a fresh
tmpfs at each emptyDir mount, read-only binds for the pod's other volumes, the container's env (downward-API
fields resolved to given values) and nothing else of ours, as the pod's runAsUser/runAsGroup/fsGroup, a uid with
no passwd entry. Needs root (mount namespaces), `unshare`, `chroot`, `setpriv` and overlayfs; `require()` skips
(fails under CI=true) without them.

How: in a private mount namespace, an overlay whose lower layer is this machine's root (its upper layer a tmpfs, so
the mount points the pod needs are made there and the real root is never written) becomes the new root; /proc,
/sys and /dev come in, the pod's volumes are mounted, the overlay is remounted read-only, and the command runs
chrooted, with no capabilities and no_new_privs. NOTE: /root is 0700 here and this machine's interpreters live
under it (pyenv); in the sandbox only, /root is made traversable (0711), as an image's Python is runnable by any
uid.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.components import missing

IMAGE_PATH = "/usr/local/bin:/usr/bin:/bin"


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


def command(pod: Pod, argv: Sequence[str], scratch: Path) -> list[str]:
    """The command line that runs `argv` in the sandbox (scratch: an empty directory of the host for the overlay)."""
    sc = {**pod.pod_spec.get("securityContext", {}), **pod.container.get("securityContext", {})}
    assert sc.get("readOnlyRootFilesystem") is True, "the sandbox runs read-only roots only"
    uid, gid = int(sc["runAsUser"]), int(sc.get("runAsGroup", sc["runAsUser"]))
    groups = ",".join(str(g) for g in {gid, int(sc.get("fsGroup", gid))})
    root, layer = scratch / "root", scratch / "layer"
    root.mkdir(parents=True)
    layer.mkdir()
    empty, binds = pod.mounts()
    q = shlex.quote
    steps = [
        f"mount -t tmpfs tmpfs {q(str(layer))}",
        f"mkdir {q(str(layer / 'u'))} {q(str(layer / 'w'))}",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={q(str(layer / 'u'))},workdir={q(str(layer / 'w'))} {q(str(root))}",
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
    steps.append(f"exec chroot {q(str(root))} setpriv --reuid={uid} --regid={gid} --groups={groups} --no-new-privs "
                 f"--inh-caps=-all --bounding-set=-all -- /usr/bin/env -i {env} {' '.join(q(a) for a in argv)}")
    return ["unshare", "-m", "--propagation", "private", "sh", "-euc", " && ".join(steps)]
