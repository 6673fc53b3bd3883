"""The KV connectors each vLLM build offers for prefill/decode, what their pods must open to each other, and which
pairs can talk (pure); `decide.runtimes` checks a deployment with it, `kube.render` renders its ports and env.

A vLLM prefill pool and a decode pool exchange KV only through one connector of one build: the connector is
named on both sides (`--kv-transfer-config`), its wire protocol and KV layout are that build's, and pdfleet's
router drives the hand-off by passing the prefill answer's `kv_transfer_params` to the decode worker, so the
prefill must answer them.

Facts and their sources:
- upstream vLLM (0.32, read from its source in `make vllm`'s runtime): NixlConnector answers the params the
  decode worker needs, listens on its side channel VLLM_NIXL_SIDE_CHANNEL_PORT (5600) at
  VLLM_NIXL_SIDE_CHANNEL_HOST, and moves blocks over UCX (RDMA, or TCP on ports chosen at run time);
  MooncakeConnector's prefill answers no params (`request_finished` returns None: a proxy must assign
  transfer ids and the bootstrap address, VLLM_MOONCAKE_BOOTSTRAP_PORT 8998), and its transfer engine binds
  a random RPC port. The router runs NIXL between two vLLM CPU servers in tests/worker/router/test_vllm_pd.py.
- vLLM-Ascend (its documentation; no Ascend card here): MooncakeConnectorV1 is its prefill/decode connector,
  with its own bootstrap and transfer-engine ports; blocks are 128 tokens once prefix caching is on.
- The other vendors' vLLM builds (Hygon's DCU, Cambricon's MLU, Kunlunxin's, Moore Threads') are forks of
  upstream that keep its connector names. NOTE: not checked against their images (none is public here).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec

UPSTREAM = "vllm"
VENDOR_BUILD = {
    "huawei": "vllm-ascend",
    "hygon": "vllm-dcu",
    "cambricon": "vllm-mlu",
    "kunlunxin": "vllm-kunlun",
    "moorethreads": "vllm-musa",
}
BUILD_NAMES = {
    UPSTREAM: "upstream vLLM",
    "vllm-ascend": "vLLM-Ascend",
    "vllm-dcu": "Hygon's vLLM (DTK)",
    "vllm-mlu": "Cambricon's vLLM",
    "vllm-kunlun": "vllm-kunlun",
    "vllm-musa": "Moore Threads' vLLM",
}
# vLLM-Ascend computes attention on 128-token blocks whenever prefix caching is on.
ASCEND_PREFIX_CACHING_BLOCK = 128


@dataclass(frozen=True)
class Connector:
    """One KV connector of one vLLM build."""

    name: str  # as --kv-transfer-config's kv_connector names it
    build: str
    symmetric: bool = False  # kv_both on both sides (NIXL), else kv_producer / kv_consumer
    ports: tuple[tuple[str, int], ...] = ()  # (containerPort name, number) its peers connect to
    port_env: tuple[tuple[str, str], ...] = ()  # env that pins those ports
    host_env: tuple[str, ...] = ()  # env set to the pod's IP (where peers reach it)
    dynamic_ports: bool = True  # its data path also uses ports chosen at run time
    refused: str | None = None  # why pdfleet's router cannot drive it (None: it can)


NIXL = Connector(
    "NixlConnector",
    UPSTREAM,
    symmetric=True,
    ports=(("kv", 5600),),
    port_env=(("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"),),
    host_env=("VLLM_NIXL_SIDE_CHANNEL_HOST",),
)
_MOONCAKE = Connector(
    "MooncakeConnector",
    UPSTREAM,
    ports=(("bootstrap", 8998),),
    port_env=(("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998"),),
    host_env=("VLLM_HOST_IP",),
    refused="its prefill answers no kv_transfer_params (a proxy must assign transfer ids and the "
    "bootstrap address), so pdfleet's router cannot hand a request over through it",
)
_ASCEND_MOONCAKE = Connector("MooncakeConnectorV1", "vllm-ascend", host_env=("VLLM_HOST_IP",))

_UPSTREAM_NAMES = (NIXL, _MOONCAKE)
CONNECTORS: dict[str, tuple[Connector, ...]] = {
    UPSTREAM: _UPSTREAM_NAMES,
    "vllm-ascend": (_ASCEND_MOONCAKE,),
    **{
        build: tuple(
            Connector(c.name, build, c.symmetric, c.ports, c.port_env, c.host_env, c.dynamic_ports, c.refused)
            for c in _UPSTREAM_NAMES
        )
        for build in ("vllm-dcu", "vllm-mlu", "vllm-kunlun", "vllm-musa")
    },
}
DEFAULT_CONNECTOR = {build: conns[0].name for build, conns in CONNECTORS.items()}


def build_of(cls: AcceleratorClassSpec) -> str:
    """The vLLM build a class's vLLM image is (by its vendor)."""
    return VENDOR_BUILD.get(cls.vendor, UPSTREAM)


def lookup(build: str, name: str | None) -> Connector:
    """The connector `name` of `build` (None: the build's default); ValueError listing the build's connectors."""
    name = name or DEFAULT_CONNECTOR[build]
    for c in CONNECTORS[build]:
        if c.name == name:
            return c
    known = ", ".join(c.name for c in CONNECTORS[build])
    raise ValueError(f"{name} is not a KV connector of {BUILD_NAMES[build]} (its connectors: {known})")


def block_size(build: str, block_size: int, prefix_caching: bool) -> int:
    """The KV block size a vLLM build computes with, given the spec's."""
    if build == "vllm-ascend" and prefix_caching:
        return ASCEND_PREFIX_CACHING_BLOCK
    return block_size


def cannot_talk(prefill: Connector, decode: Connector) -> str | None:
    """Why a prefill pool on `prefill` and a decode pool on `decode` cannot exchange KV (None: they can)."""
    if (prefill.build, prefill.name) == (decode.build, decode.name):
        return None
    if prefill.build != decode.build:
        return (
            f"{BUILD_NAMES[prefill.build]}'s {prefill.name} and {BUILD_NAMES[decode.build]}'s {decode.name} are two "
            f"KV transfer implementations (wire protocol and KV layout of their own) that cannot exchange blocks"
        )
    return f"{prefill.name} on one side and {decode.name} on the other cannot exchange blocks"
