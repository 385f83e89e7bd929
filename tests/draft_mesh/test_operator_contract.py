"""What the operator hands decode and drafter pods is what the engine reads: the peers file's
drafter endpoints, the speculative env vars and the drafter's command line (no cluster)."""

from __future__ import annotations

from pathlib import Path

from splitserve.api.serve_config import build_parser
from splitserve.config_flags import config_from_args
from splitserve.draft_mesh.config import SpecConfig, default_verifier_rank, drafters_from_peers
from splitserve.operator.group_builders import build_peers_configmap, build_serving_role
from splitserve.operator.role_builders import build_statefulset
from splitserve.operator.rollout import group_revision


def group() -> dict:
    spec = {"model": {"name": "m", "imagePath": "/opt/m"}, "transfer": {"protocol": "tcp"},
            "roles": {"prefill": {}, "decode": {"replicas": 2}, "drafter": {"replicas": 2}},
            "speculative": {"numDraftTokens": 5, "meshPort": 50070,
                            "draftModel": {"name": "small", "imagePath": "/opt/small"}}}
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "ServingGroup",
            "metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 1}, "spec": spec}


def container(role: str) -> dict:
    body = build_serving_role(group(), role, group_revision(group()["spec"]), 0, None)
    body["metadata"]["uid"] = f"uid-{role}"
    (c,) = build_statefulset(body, "example.com/splitserve:test")["spec"]["template"]["spec"]["containers"]
    return c


def test_decode_pods_find_every_drafter_in_the_peers_file(tmp_path: Path) -> None:
    peers = tmp_path / "peers.json"
    peers.write_text(build_peers_configmap(group(), {"prefill": 1, "decode": 2, "drafter": 2})["data"]["peers.json"])
    assert drafters_from_peers(str(peers)) == ["g-drafter-0.g-drafter.ns.svc:50070",
                                               "g-drafter-1.g-drafter.ns.svc:50070"]


def test_the_speculative_env_of_decode_and_drafter_pods_configures_the_mesh() -> None:
    for role in ("decode", "drafter"):
        env = {e["name"]: e["value"] for e in container(role)["env"] if "value" in e}
        spec = config_from_args(SpecConfig, build_parser().parse_args([]), "SPLITSERVE", environ=env)
        assert (spec.num_draft_tokens, spec.draft_mesh_port) == (5, 50070)
        assert spec.peers_file == env.get("SPLITSERVE_PEERS_FILE", "") != ""


def test_the_drafter_command_is_a_drafter_engine_on_the_draft_model() -> None:
    command = container("drafter")["command"]
    args = build_parser().parse_args(command[command.index("serve") + 1:])
    assert args.role == "drafter" and args.model == "/opt/small"


def test_a_verifier_rank_is_the_pods_replica_index() -> None:
    assert default_verifier_rank({"SPLITSERVE_REPLICA_INDEX": "3"}) == 3
    assert default_verifier_rank({"SPLITSERVE_REPLICA_INDEX": "", "SPLITSERVE_POD_NAME": "g-decode-7"}) == 7
    assert default_verifier_rank({}) == 0
