"""The disaggregated roles' behaviours, one module each, and the list each `--role` is made of
(roles compose: see engine/role.py)."""

from __future__ import annotations

from splitserve.draft_mesh import SpecConfig
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.epd_config import EPDConfig
from splitserve.engine.multimodal.image_inputs import ImageInputConfig
from splitserve.engine.role import ComposedRole, Role
from splitserve.transfer import TransferConfig


def build_role(cfg: EngineConfig, transfer: TransferConfig, spec: SpecConfig | None = None, *,
               epd: EPDConfig | None = None, images: ImageInputConfig | None = None) -> Role:
    """The role for `--role`: its behaviours in hook order; raises for roles this build cannot run."""
    return ComposedRole(cfg.role, role_behaviours(cfg, transfer, spec or SpecConfig(), epd or EPDConfig(),
                                                  images or ImageInputConfig()))


def takes_images(cfg: EngineConfig) -> bool:
    from splitserve.engine.checkpoints.model_names import resolve_model_path
    return ModelConfig.from_checkpoint(resolve_model_path(cfg.model, cfg.seed)).takes_images


def role_behaviours(cfg: EngineConfig, transfer: TransferConfig, spec: SpecConfig, epd: EPDConfig,
                    images: ImageInputConfig) -> list[Role]:
    """What `--role` adds to the loop, one behaviour per concern (the KV sender of prefill, ...)."""
    if cfg.role == "prefill":
        from splitserve.engine.roles.prefill import PrefillRole
        if takes_images(cfg):  # the KV sender, and the receiver of encoder-computed image rows
            from splitserve.engine.roles.embedding_receiving import EmbeddingReceivingRole
            return [PrefillRole(transfer), EmbeddingReceivingRole(transfer, epd)]
        return [PrefillRole(transfer)]  # the KV sender
    if cfg.role == "decode":
        from splitserve.engine.roles.decode import DecodeRole
        return [DecodeRole(transfer), *verifier(transfer, spec)]  # the KV receiver (+ the verifier)
    if cfg.role == "unified":
        return verifier(transfer, spec) or [Role()]
    if cfg.role == "drafter":
        from splitserve.engine.roles.drafter import DrafterRole
        return [DrafterRole(spec, transfer)]  # the draft model + the draft mesh server
    if cfg.role == "encode":
        from splitserve.engine.roles.encode import EncodeRole
        if not takes_images(cfg):
            raise ValueError(f"--role encode needs a multimodal model; {cfg.model} takes no images")
        if cfg.tp_size > 1:
            raise ValueError("--role encode runs on one rank (the vision tower is not sharded): give it "
                             "--tp-size 1 and scale encode replicas instead")
        return [EncodeRole(transfer, epd, images)]  # vision tower + embedding sender
    raise ValueError(f"--role {cfg.role} is not implemented yet")


def verifier(transfer: TransferConfig, spec: SpecConfig) -> list[Role]:
    """The verifier behaviour when there are drafters to join (--drafter), or a peers file that lists
    them (now or later: it is read again while the engine runs), else nothing."""
    if not spec.drafter and not spec.peers_file:
        return []
    from splitserve.engine.roles.verifier import VerifierRole
    return [VerifierRole(spec, transfer)]
