"""Roles compose: a role made of several behaviours calls each one's hooks, in order, on a real engine."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.offline import GenerationFailed, generate_tokens
from splitserve.engine.request import FinishReason, Request
from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


class Recorder(Role):
    """Logs the hooks it sees, under its own name, into a log shared with its siblings."""

    def __init__(self, name: str, log: list[tuple[str, str]], poll_interval: float | None = None) -> None:
        self.label, self.log, self.poll_interval = name, log, poll_interval

    def on_arrival(self, req: Request) -> bool:
        self.log.append((self.label, "arrival"))
        return False

    def on_token(self, req: Request, finish: FinishReason | None) -> bool:
        self.log.append((self.label, "token"))
        return False

    def on_finish(self, req: Request) -> None:
        self.log.append((self.label, "finish"))

    def before_launch(self) -> None:
        self.log.append((self.label, "launch"))

    def health_info(self) -> dict[str, str]:
        return {self.label: "ok"}

    def idle_poll_interval(self) -> float | None:
        return self.poll_interval


class Refuser(Role):
    """Refuses every request at arrival, as a role does with bad bootstrap fields."""

    def on_arrival(self, req: Request) -> bool:
        self.engine.finish(req, FinishReason.ERROR, "refused by the test behaviour")
        return True


def run_engine(role: ComposedRole, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024,
                                 max_running_requests=4), role=role)
    engine.start()
    try:
        return generate_tokens(engine, prompts, GREEDY)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def plain_tokens() -> list[list[int]]:
    return run_engine(ComposedRole("unified", [Role()]), [[1, 2, 3, 4, 5]])


def test_every_behaviour_sees_every_hook_in_list_order(plain_tokens: list[list[int]]) -> None:
    log: list[tuple[str, str]] = []
    role = ComposedRole("unified", [Recorder("a", log, 0.5), Recorder("b", log, 0.2)])
    assert run_engine(role, [[1, 2, 3, 4, 5]]) == plain_tokens  # behaviours that take nothing change nothing
    assert log[:2] == [("a", "arrival"), ("b", "arrival")]
    tokens = [entry for entry in log if entry[1] == "token"]
    assert tokens == [("a", "token"), ("b", "token")] * 6
    # One step per token (the prompt's, then five decode steps), each announced to both before it is launched.
    launches = [entry for entry in log if entry[1] == "launch"]
    assert launches == [("a", "launch"), ("b", "launch")] * 6
    assert [e for e in log if e[1] in ("launch", "token")][:4] == [("a", "launch"), ("b", "launch"), ("a", "token"),
                                                                  ("b", "token")]
    assert log[-2:] == [("a", "finish"), ("b", "finish")]
    assert role.health_info() == {"a": "ok", "b": "ok"}
    assert role.idle_poll_interval() == 0.2


def test_a_refusal_stops_the_later_behaviours_from_seeing_the_request() -> None:
    log: list[tuple[str, str]] = []
    role = ComposedRole("unified", [Refuser(), Recorder("after", log)])
    with pytest.raises(GenerationFailed, match="refused by the test behaviour"):
        run_engine(role, [[1, 2, 3]])
    assert ("after", "arrival") not in log
    assert role.idle_poll_interval() is None


def test_a_role_needs_a_behaviour() -> None:
    with pytest.raises(ValueError, match="at least one behaviour"):
        ComposedRole("prefill", [])


def test_a_composed_role_serves_structured_outputs_if_any_behaviour_does_and_encode_or_drafter_does_not() -> None:
    from splitserve.draft_mesh import SpecConfig
    from splitserve.engine.epd_config import EPDConfig
    from splitserve.engine.multimodal.image_inputs import ImageInputConfig
    from splitserve.engine.roles.drafter import DrafterRole
    from splitserve.engine.roles.encode import EncodeRole
    from splitserve.transfer import TransferConfig

    encode = EncodeRole(TransferConfig(), EPDConfig(), ImageInputConfig())
    drafter = DrafterRole(SpecConfig(), TransferConfig())
    assert not encode.serves_structured_outputs() and not drafter.serves_structured_outputs()
    assert not ComposedRole("encode", [encode]).serves_structured_outputs()
    assert ComposedRole("mixed", [encode, Role()]).serves_structured_outputs()
    assert Role().serves_structured_outputs()
