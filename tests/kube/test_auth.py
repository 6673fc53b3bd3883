"""The deployment token in Kubernetes: rendered mounts and flags (router and pdfleet workers get the token, decode
workers pull only from the prefill Service, vLLM pods get nothing, client API keys from an optional Secret), the Secret
itself, and the operator creating it when missing without ever overwriting it (a 409 keeps the token; deleting it
rotates it)."""

from __future__ import annotations

import argparse
import base64
import time

import kubernetes_validate
import pytest

from pdfleet_operator.api.names import LABEL_DEPLOYMENT
from pdfleet_operator.decide import inventory, placement
from pdfleet_operator.kube import handlers, render, token_secret
from pdfleet_operator.kube.token_secret import ANNOTATION_RECREATE_TOKEN
from tests.kube.cluster import EXAMPLES as EXAMPLE_DIR
from tests.kube.cluster import classes, example_deployments, pod, spec_of, standard_nodes
from tests.kube.harness import events, prepare_cluster, running_operator, settle, wait_reconciled

CLASSES = classes()
EXAMPLES = example_deployments()
TOKEN_FILE = "/var/run/pdfleet/auth/token"


def rendered(name: str) -> list[dict]:
    spec = spec_of(EXAMPLES[name])
    plan = placement.plan(spec, CLASSES, inventory.build(standard_nodes(), []))
    return render.render(render.Owner(name, "team-a", "uid-" + name), spec, plan, CLASSES, revision=1)


def pods(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_pod_that_speaks_pdfleet_gets_the_token_and_only_those(name: str) -> None:
    objs = rendered(name)
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    for pod_name, pod_spec in pods(objs).items():
        (container,) = pod_spec["containers"]
        args, volumes = container["args"], {v["name"]: v for v in pod_spec["volumes"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        if container["name"] == "vllm":  # vLLM has no use for the token: least privilege
            assert "auth" not in volumes and "--auth-token-file" not in args, pod_name
            continue
        assert flag(args, "--auth-token-file") == TOKEN_FILE, pod_name
        assert volumes["auth"]["secret"] == {
            "secretName": f"{name}-auth",
            "defaultMode": 0o440,
            "items": [{"key": "token", "path": "token"}],
        }
        # No subPath: kubelet updates a mounted Secret in place only without one (the rotation relies on it).
        assert mounts["auth"] == {"name": "auth", "mountPath": "/var/run/pdfleet/auth", "readOnly": True}
        role = pod_name.removeprefix(f"{name}-").split("-")[0]
        if container["name"] == "router":
            assert flag(args, "--api-key-file") == "/var/run/pdfleet/api-keys/api-keys"
            assert "--api-key-file-optional" in args
            assert volumes["api-keys"]["secret"] == {
                "secretName": f"{name}-api-keys",
                "defaultMode": 0o440,
                "items": [{"key": "api-keys", "path": "api-keys"}],
                "optional": True,
            }
        elif role == "decode":
            peers = flag(args, "--kv-peers")
            assert peers == f"{name}-prefill.team-a.svc:8001", "the prefill role's headless Service, its KV port"
            assert peers.split(".")[0] in services
        else:
            assert "--kv-peers" not in args and "--api-key-file" not in args, pod_name
    prefill = [p for n, p in pods(objs).items() if "-prefill-" in n and p["containers"][0]["name"] == "worker"]
    for pod_spec in prefill:
        assert {"name": "kv", "containerPort": 8001, "protocol": "TCP"} in pod_spec["containers"][0]["ports"]


def test_rendered_flags_parse_with_the_worker_cli_and_name_the_peers() -> None:
    from pdfleet_worker import cli
    from pdfleet_worker.kv_transfer import peers

    parser = argparse.ArgumentParser(prog="pdfleet")
    cli.register(parser.add_subparsers(dest="command"))
    spec = spec_of(EXAMPLES["llama31-8b"])
    owner = render.Owner("llama31-8b", "team-a", "uid")
    decode = parser.parse_args(render.worker_args(spec, "decode", owner=owner))
    assert decode.auth_token_file == TOKEN_FILE
    assert peers.parse(decode.kv_peers) == [peers.Peer("llama31-8b-prefill.team-a.svc", 8001)]
    router = parser.parse_args(render.router_args(owner, ["prefill", "decode"]))
    assert (router.auth_token_file, router.api_key_file, router.api_key_file_optional) == (
        TOKEN_FILE,
        "/var/run/pdfleet/api-keys/api-keys",
        True,
    )


def test_the_token_secret_is_valid_owned_and_holds_the_token() -> None:
    owner = render.Owner("chat", "team-a", "uid-1")
    secret = render.auth_secret(owner, "s3cr3t-token-of-enough-length")
    kubernetes_validate.validate(secret, "1.30.0", strict=True)
    assert secret["metadata"]["name"] == "chat-auth" and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"] == [owner.reference()], "garbage-collected with its CR"
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cr3t-token-of-enough-length"
    assert (
        render.auth_secret_name("x" * 63) == render.auth_secret_name("x" * 63)
        and len(render.auth_secret_name("x" * 63)) <= 63
    )


def token_of(kube, name: str, namespace: str = "default") -> str | None:
    obj = kube.get("secrets", f"{name}-auth", namespace)
    return None if obj is None else base64.b64decode(obj["data"]["token"]).decode()


def test_the_operator_creates_the_token_once_never_overwrites_it_and_recreates_it_when_deleted(
    kube, monkeypatch
) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(EXAMPLE_DIR / "local-tiny.yaml")
        wait_reconciled(kube, "local-tiny")
        settle(kube)
        first = token_of(kube, "local-tiny")
        assert first is not None and len(first) >= 32
        secret = kube.get("secrets", "local-tiny-auth", "default")
        cr = kube.get("infdep", "local-tiny", "default")
        assert secret["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
        assert [(w.verb, w.status) for w in kube.writes("secrets")] == [("create", 201)]
    kube.clear_requests()
    with running_operator(kube, resync_interval=0.2):  # a restart and resyncs: status.tokenSecret says it exists
        kube.wait_for(lambda: handlers.RECONCILER.reconciles >= 3, timeout=20, message="a restart and resyncs")
        settle(kube)
        assert kube.get("infdep", "local-tiny", "default")["status"]["tokenSecret"] == "local-tiny-auth"
        assert kube.writes("secrets") == [], "a restart writes nothing for the Secret the status says was made"
        # A steady fleet checks nothing: the Secret is checked again only when something needs it.
        time.sleep(0.5)
        assert kube.writes("secrets") == []
        # A new pod of the deployment mounts it: one create (answered 409: the token kept), at most once a minute.
        labels = {LABEL_DEPLOYMENT: "local-tiny"}
        kube.apply(pod("local-tiny-decode-a", "h100-0", {"cpu": "1"}, labels=labels))
        kube.wait_for(lambda: kube.writes("secrets"), timeout=20, message="the new pod's check of the Secret")
        kube.apply(pod("local-tiny-decode-b", "h100-0", {"cpu": "1"}, labels=labels))
        settle(kube)
        assert [(w.verb, w.status) for w in kube.writes("secrets")] == [("create", 409)]
        assert token_of(kube, "local-tiny") == first, "the token the pods hold is never replaced"
        # An admin deletes the Secret; a pod that then starts (an eviction's replacement) is not left waiting for it.
        kube.delete("secrets", "local-tiny-auth", "default")
        monkeypatch.setattr(token_secret, "AUTH_SECRET_CHECK_S", 0.0)
        kube.apply(pod("local-tiny-decode-c", "h100-0", {"cpu": "1"}, labels=labels))
        kube.wait_for(
            lambda: token_of(kube, "local-tiny") not in (None, first),
            timeout=20,
            message="a new token for the new pod after the Secret was deleted",
        )
        second = token_of(kube, "local-tiny")
        # Rotation by hand: delete the Secret, then `kubectl annotate infdep local-tiny pdfleet.io/recreate-token=1`.
        kube.delete("secrets", "local-tiny-auth", "default")
        kube.patch("infdep", "local-tiny", {"metadata": {"annotations": {ANNOTATION_RECREATE_TOKEN: "1"}}})
        kube.wait_for(
            lambda: token_of(kube, "local-tiny") not in (None, first, second),
            timeout=20,
            message="a new token after the Secret was deleted and the annotation set",
        )
        kube.wait_for(
            lambda: (
                ANNOTATION_RECREATE_TOKEN
                not in (kube.get("infdep", "local-tiny", "default")["metadata"].get("annotations") or {})
            ),
            message="the one-shot annotation removed",
        )
        kube.wait_for(
            lambda: any(e["reason"] == "TokenSecretCreated" for e in events(kube, "local-tiny")),
            message="the TokenSecretCreated Event",
        )
        operator = {r.verb for r in kube.requests_for(resource="secrets") if r.user is not None}
        assert operator == {"create"}, "the operator never reads, lists, watches, patches or deletes a Secret"
