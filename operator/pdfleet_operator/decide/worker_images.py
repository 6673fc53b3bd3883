"""Which pdfleet worker image drives which accelerators: the platform of a class and of an image, and the operator's
default image per platform (pure); `decide.runtimes` resolves a pool's image with it, `pdfleet operator` parses
its `--worker-image PLATFORM=IMAGE` flags into it.

A worker image is built for one *platform*: the torch build and vendor bridge inside it. `make images` tags them
`<repository>:<version>-<platform>`:

    cpu    CPU torch                           (vendor cpu; any class whose device is cpu)
    cuda   NVIDIA's CUDA torch                 (nvidia: whole GPUs and MIG slices)
    dtk    Hygon DTK's torch (CUDA API on DCUs) (hygon: same `cuda` torch device, another torch build)
    npu    torch_npu on CANN                   (huawei Ascend)
    mlu    torch_mlu on Cambricon Neuware      (cambricon)
    xpu    torch with Intel's XPU backend      (intel)
    rocm   ROCm torch                          (amd)

NOTE: the platform is not the torch device: Hygon's DCUs compute as `cuda` under DTK's torch, which NVIDIA's CUDA
build cannot drive. An image's platform is known when the operator's defaults name it or its tag ends in
`-<platform>`; an image of unknown platform is trusted (the worker still refuses, at start, a device its torch
does not see: DeviceUnavailable, never a CPU fallback).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec

PLATFORMS = ("cpu", "cuda", "dtk", "npu", "mlu", "xpu", "rocm")
VENDOR_PLATFORM = {
    "cpu": "cpu",
    "nvidia": "cuda",
    "hygon": "dtk",
    "huawei": "npu",
    "cambricon": "mlu",
    "intel": "xpu",
    "amd": "rocm",
}
WHAT = {
    "cpu": "CPU torch",
    "cuda": "NVIDIA's CUDA torch",
    "dtk": "Hygon DTK's torch",
    "npu": "torch_npu (CANN)",
    "mlu": "torch_mlu (Neuware)",
    "xpu": "torch for Intel XPUs",
    "rocm": "ROCm torch",
}
DEFAULT_REPOSITORY = "ghcr.io/pdfleet/pdfleet-worker"
DEFAULT_VERSION = "0.1.0"  # pdfleet_operator.__version__ (tests keep them equal)
# What `make images` builds with no vendor base image given, and so the chart's default workerImage.platforms.
BUILT_BY_DEFAULT = ("cpu", "cuda")
_TAG = re.compile(r":[^/@]*-(" + "|".join(PLATFORMS) + r")$")


def class_platform(cls: AcceleratorClassSpec) -> str:
    """The platform a pdfleet worker on this class needs: cpu when it computes on CPU, else its vendor's."""
    if (cls.runtimes.pdfleet.device or "") == "cpu" or cls.resource_name == "cpu":
        return "cpu"
    return VENDOR_PLATFORM.get(cls.vendor, cls.vendor)


def image_platform(image: str) -> str | None:
    """The platform an image's tag names (`...:0.1.0-cuda` -> cuda), None when it names none."""
    m = _TAG.search(image.split("@", 1)[0])
    return m.group(1) if m else None


def tagged(repository: str, version: str, platform: str) -> str:
    """The image `make images` builds for `platform`."""
    return f"{repository}:{version}-{platform}"


@dataclass(frozen=True)
class WorkerImages:
    """The operator's default pdfleet worker image per platform (`--worker-image PLATFORM=IMAGE`, chart
    workerImage.platforms): a pool whose class and deployment name no image takes the one of its class's platform."""

    images: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, images: Mapping[str, str]) -> "WorkerImages":
        for platform, image in images.items():
            if not platform or not image:
                raise ValueError(f"worker image {platform!r}={image!r}: both the platform and the image are needed")
            named = image_platform(image)
            if named is not None and named != platform:
                raise ValueError(f"worker image for {platform} is tagged for {named}: {image}")
        return cls(tuple(sorted(images.items())))

    @classmethod
    def parse(cls, flags: Iterable[str]) -> "WorkerImages":
        """From `PLATFORM=IMAGE` (or an `IMAGE` whose tag ends in -PLATFORM); ValueError naming a bad one."""
        out: dict[str, str] = {}
        for flag in flags:
            platform, sep, image = flag.partition("=")
            if not sep:
                image, platform = flag, image_platform(flag) or ""
                if not platform:
                    raise ValueError(
                        f"{flag}: name the platform it drives, e.g. cuda={flag} (platforms: {', '.join(PLATFORMS)})"
                    )
            if platform in out:
                raise ValueError(f"two worker images for {platform}: {out[platform]} and {image}")
            out[platform.strip()] = image.strip()
        return cls.of(out)

    def get(self, platform: str) -> str | None:
        return dict(self.images).get(platform)

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.images)

    def describe(self) -> str:
        """`cpu=IMAGE, cuda=IMAGE` (status.workerImage, messages)."""
        return ", ".join(f"{p}={i}" for p, i in self.images)


def defaults(
    repository: str = DEFAULT_REPOSITORY,
    version: str = DEFAULT_VERSION,
    platforms: Iterable[str] = BUILT_BY_DEFAULT + ("dtk", "npu", "mlu"),
) -> WorkerImages:
    """The operator's defaults without --worker-image: the unpublished ghcr.io names of every platform with a worker
    build recipe (the Dockerfile's worker and vendor targets)."""
    return WorkerImages.of({p: tagged(repository, version, p) for p in platforms})


DEFAULTS = defaults()
