"""What `generate`, `serve` and `bench` run: an engine directory plus speculative settings.

`EngineGenerator` implements the server's `TextGenerator` protocol. Each request gets a fresh
`Decoder` (and proposer) so no state leaks between sequences; metrics of finished requests are
merged into one aggregate for `/metrics`. The speculative config was validated when parsed; the
parts that need the engine (the drafter exists, γ against its block size, the MTP head exists)
are resolved here once, at start-up, before the first request.
"""

from __future__ import annotations

from typing import Iterator

from metrale.runtime.decode import Decoder
from metrale.runtime.engine import LoadedEngine
from metrale.runtime.errors import ConfigError
from metrale.runtime.metrics import SpecMetricsAggregate
from metrale.runtime.sampling import SamplingParams
from metrale.runtime.spec_dflash import DFlashProposer
from metrale.runtime.spec_mtp import MTPProposer
from metrale.runtime.specconfig import SpecMode, SpeculativeConfig, resolve_dflash


def check_engine_supports(engine: LoadedEngine, spec: SpeculativeConfig):
    """Resolve the engine-dependent settings; refuse what the engine directory cannot run."""
    if spec.mode is SpecMode.MTP and engine.mtp is None:
        raise ConfigError(f"--speculative needs an MTP head; engine directory {engine.path} has none")
    if spec.mode is SpecMode.DFLASH:
        name = spec.dflash_drafter
        if name not in engine.drafters:
            have = ", ".join(sorted(engine.drafters)) or "none"
            raise ConfigError(f"--dflash-drafter {name!r}: engine directory {engine.path} has no such "
                              f"drafter (it has: {have})")
        return resolve_dflash(spec, engine.drafters[name].config.block_size)
    return None


class EngineGenerator:
    def __init__(self, engine: LoadedEngine, spec: SpeculativeConfig | None = None):
        self.engine = engine
        self.spec = spec or SpeculativeConfig()
        self.dflash = check_engine_supports(engine, self.spec)
        self.tokenizer = engine.tokenizer
        self.model_id = engine.model_id
        self.max_context = engine.target.config.max_position_embeddings
        self.metrics = SpecMetricsAggregate()

    def decoder(self) -> Decoder:
        e, spec = self.engine, self.spec
        embed = e.target.model.embed_tokens
        max_len = self.max_context + 64
        proposer = None
        if spec.mode is SpecMode.MTP:
            proposer = MTPProposer(e.mtp, embed, spec.num_drafts, spec.draft_stop, max_len)
        elif spec.mode is SpecMode.DFLASH:
            proposer = DFlashProposer(e.drafters[self.dflash.drafter], embed, self.dflash, max_len)
        return Decoder(e.target, self.tokenizer.eos_token_ids, proposer, spec.exact_verify, self.max_context)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        decoder = self.decoder()
        try:
            yield from decoder.stream(prompt_ids, params)
        finally:
            if decoder.last_result is not None:
                self.metrics.add(decoder.last_result.metrics)

    def metrics_text(self) -> str:
        return self.metrics.prometheus_text()
