"""Per-request sampling state of a model runner: each step's `SamplingBatch` built from the
requests' parameters and tokens, and the seeded requests' own generators (shared by the
target's runner and a draft model's)."""

from __future__ import annotations

import dataclasses
import operator

import torch

from tokenmill.core.request import Request
from tokenmill.host_to_device import on_device
from tokenmill.sample.sampler import SamplingBatch, adjusted, banned_by_bad_words, draw


class RequestSampling:
    def __init__(self, vocab_size: int, device: torch.device, seed_offset: int = 0) -> None:
        """`seed_offset`: added to each request's seed (a draft model's draws must not repeat
        the target's, whose rejection test they would then bias)."""
        self.vocab_size = vocab_size
        self.device = device
        self.seed_offset = seed_offset
        self._generators: dict[str, torch.Generator] = {}
        # the last `batch` call's requests and their settings (`_settings_of`)
        self._settings: tuple[list[Request], _Settings] | None = None

    def drop(self, request_ids) -> None:
        """Forget finished requests' generators."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def generator(self, request: Request) -> torch.Generator | None:
        """A seeded sampling request's own generator (made on its first draw); None for the
        others, and for a request finished while its micro-batch was in flight (its token is
        dropped)."""
        p = request.sampling_params
        if p.seed is None or p.temperature == 0 or request.status.finished:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(p.seed + self.seed_offset)
            self._generators[request.request_id] = gen
        return gen

    def drafted_batch(self, request: Request, drafts: list[int]) -> SamplingBatch:
        """The rows verifying `drafts`: row j as if drafts 1 .. j were already output (its
        penalties, min_tokens and bad-word bans; the request's own generator)."""
        if not request.samples_from_history:
            return self.batch([request] * (len(drafts) + 1))
        return self.batch([dataclasses.replace(
            request, output_token_ids=request.output_token_ids + drafts[:j])
            for j in range(len(drafts) + 1)])

    def draft(self, logits: torch.Tensor, requests: list[Request],
              generator: torch.Generator | None, host: bool = True
              ) -> tuple[list[int] | torch.Tensor, torch.Tensor | None]:
        """A proposer's draft token for each row of `logits` (greedy, or drawn under the
        request's settings: penalties and bans of its tokens so far; `host` False: left on
        the device), and, with sampling rows, the distributions drawn from."""
        batch = self.batch(requests)
        width = logits.shape[1]  # (a draft's vocabulary may be the smaller)
        batch.banned = [(row, [i for i in ids if i < width]) for row, ids in batch.banned]
        batch.bias = [(row, [i for i in ids if i < width], [v for i, v in zip(ids, vs)
                                                           if i < width])
                      for row, ids, vs in batch.bias]
        batch.allowed = [(row, kept) for row, ids in batch.allowed
                         if (kept := [i for i in ids if i < width])]
        tokens, probs = draw(adjusted(logits, batch), batch, generator)
        return (tokens.tolist() if host else tokens), probs

    def count_in_flight(self, batch: SamplingBatch, rows: list[tuple[int, int]],
                        tokens: torch.Tensor) -> None:
        """Penalties of rows whose request's latest token is still on the device (a step in
        flight sampled it, asynchronous scheduling): (row, its index in `tokens`) pairs."""
        rows_t, sources = (on_device(list(x), torch.int64, self.device) for x in zip(*rows))
        latest = tokens.index_select(0, sources).to(torch.int64)
        if batch.seen_mask is not None:  # (kept: the token is the request's next one)
            batch.seen_mask[rows_t, latest] = True
        if batch.output_counts is not None:
            batch.output_counts.index_put_((rows_t, latest), torch.ones(
                len(rows), device=self.device), accumulate=True)
            if self._settings is not None and batch.output_counts is self._settings[1].counts:
                # taken back before the next step counts the token from the host
                self._settings[1].in_flight.append((rows_t, latest))

    def _new_tokens(self, upto: list[int], requests: list[Request], output_only: bool
                    ) -> tuple[list[int], list[int]]:
        """(rows, tokens) of each request's tokens past `upto` (updated): prompt and output,
        or the output alone."""
        rows: list[int] = []
        tokens: list[int] = []
        for row, r in enumerate(requests):
            have, total = upto[row], r.num_output_tokens if output_only else r.num_tokens
            if total > have:
                new = r.output_token_ids[have:] if output_only else r.token_ids(have, total)
                rows += [row] * len(new)
                tokens += new
                upto[row] = total
        return rows, tokens

    def _seen(self, settings: _Settings, requests: list[Request]) -> torch.Tensor:
        """Which tokens each row's request has had (prompt and output), kept while the same
        requests run and updated by their new tokens: O(new tokens) a step, where marking
        every token again cost O(context) per request (64 at 8k tokens: 25 ms on the CPU)."""
        if settings.seen is None:
            settings.seen = torch.zeros(len(requests), self.vocab_size, dtype=torch.bool,
                                        device=self.device)
            settings.seen_upto = [0] * len(requests)
        rows, tokens = self._new_tokens(settings.seen_upto, requests, output_only=False)
        if rows:
            settings.seen[on_device(rows, torch.int64, self.device),
                          on_device(tokens, torch.int64, self.device)] = True
        return settings.seen

    def _counts(self, settings: _Settings, requests: list[Request]) -> torch.Tensor:
        """Each row's output token counts, kept and updated as `_seen` (the counts of tokens
        that were still on the device taken back first: they are on the host now)."""
        dev = self.device
        if settings.counts is None:
            settings.counts = torch.zeros(len(requests), self.vocab_size, device=dev)
            settings.counted_upto = [0] * len(requests)
        self._take_back(settings)
        rows, tokens = self._new_tokens(settings.counted_upto, requests, output_only=True)
        if rows:
            settings.counts.index_put_(
                (on_device(rows, torch.int64, dev), on_device(tokens, torch.int64, dev)),
                torch.ones(len(rows), device=dev), accumulate=True)
        return settings.counts

    def batch(self, requests: list[Request]) -> SamplingBatch:
        """One row per entry of `requests` (a request may fill several rows: its drafts')."""
        if (self._settings is None or len(requests) != len(self._settings[0])
                or not all(map(operator.is_, requests, self._settings[0]))):
            old = self._settings
            self._settings = list(requests), self._settings_of(requests)
            if old is not None:
                self._carry(*old, requests, self._settings[1])
        settings = self._settings[1]
        batch = dataclasses.replace(settings.batch, banned=[],
                                    generators=dict(settings.batch.generators))
        if batch.repetition_penalty is not None:
            batch.seen_mask = self._seen(settings, requests)
        if batch.frequency_penalty is not None or batch.presence_penalty is not None:
            batch.output_counts = self._counts(settings, requests)
        for row in settings.banning_rows:
            r = requests[row]
            p = r.sampling_params
            if r.num_outputs_before_draw < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else p.eos_token_ids)
                if banned:
                    batch.banned.append((row, banned))
            if p.bad_words_token_ids:
                banned = banned_by_bad_words(r.output_token_ids, p.bad_words_token_ids)
                if banned:
                    batch.banned.append((row, banned))
        for row in list(batch.generators):
            if requests[row].status.finished:  # (its token is dropped: see `generator`)
                del batch.generators[row]
        return batch

    def _carry(self, old_requests: list[Request], old: _Settings, requests: list[Request],
               new: _Settings) -> None:
        """A changed request list: the penalties' rows of requests that were in the last one
        move to their new rows in one gather (a request that ended or arrived changes the
        list, nearly every step of a busy server: re-marking every request's tokens took
        35 ms at 64 x 2k tokens on the CPU); only new requests' tokens are marked."""
        if old.seen is None and old.counts is None:  # (no penalties ran: nothing to carry)
            return
        rows = {}
        for row, r in enumerate(old_requests):
            rows.setdefault(id(r), row)
        sources = [rows.get(id(r), -1) for r in requests]
        if all(s < 0 for s in sources):
            return
        index = on_device([max(s, 0) for s in sources], torch.int64, self.device)
        fresh = [row for row, source in enumerate(sources) if source < 0]
        fresh_t = on_device(fresh, torch.int64, self.device) if fresh else None

        def moved(rows_of: torch.Tensor, upto: list[int]) -> tuple[torch.Tensor, list[int]]:
            taken = rows_of[index]  # (bool rows: faster than index_select on CPUs)
            if fresh_t is not None:
                taken[fresh_t] = 0
            return taken, [upto[s] if s >= 0 else 0 for s in sources]

        if old.seen is not None and new.batch.repetition_penalty is not None:
            new.seen, new.seen_upto = moved(old.seen, old.seen_upto)
        if old.counts is not None and (new.batch.frequency_penalty is not None
                                       or new.batch.presence_penalty is not None):
            self._take_back(old)
            new.counts, new.counted_upto = moved(old.counts, old.counted_upto)

    def _take_back(self, settings: _Settings) -> None:
        """Counts added for tokens that were on the device (now on the host: counted from
        there)."""
        for rows_t, latest in settings.in_flight:
            settings.counts.index_put_((rows_t, latest), torch.full(
                (len(rows_t),), -1.0, device=self.device), accumulate=True)
        settings.in_flight.clear()

    def _settings_of(self, requests: list[Request]) -> _Settings:
        """What the rows' parameters alone decide (the same while the same requests run in
        the same order, as in steady decoding: built once, not every step)."""
        dev = self.device
        params = [r.sampling_params for r in requests]

        def column(name: str, neutral: float, dtype=torch.float32) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(v == neutral for v in values):
                return None
            return on_device(values, dtype, dev)

        temperatures = [p.temperature for p in params]
        batch = SamplingBatch(
            temperature=on_device(temperatures, torch.float32, dev),
            all_greedy=not any(temperatures),
            top_p=column("top_p", 1.0), top_k=column("top_k", 0, torch.int64),
            min_p=column("min_p", 0.0),
            repetition_penalty=column("repetition_penalty", 1.0),
            frequency_penalty=column("frequency_penalty", 0.0),
            presence_penalty=column("presence_penalty", 0.0),
            num_logprobs=[p.logprobs for p in params],
        )
        banning_rows = []
        for row, (r, p) in enumerate(zip(requests, params)):
            if p.min_tokens or p.bad_words_token_ids:
                banning_rows.append(row)
            if p.logit_bias:
                batch.bias.append((row, list(p.logit_bias), list(p.logit_bias.values())))
            if p.allowed_token_ids:
                batch.allowed.append((row, p.allowed_token_ids))
            gen = self.generator(r)
            if gen is not None:
                batch.generators[row] = gen
        return _Settings(batch, banning_rows)


@dataclasses.dataclass
class _Settings:
    batch: SamplingBatch  # the rows' settings; no penalty counts, bans or finished rows
    banning_rows: list[int]  # rows whose bans depend on the tokens so far (min_tokens, bad words)
    # penalty state while the same requests run: seen tokens (prompt and output) and output
    # counts per row, with how many of each request's tokens they hold; the counts of tokens
    # a step in flight sampled (asynchronous scheduling), taken back at the next step
    seen: torch.Tensor | None = None
    seen_upto: list[int] = dataclasses.field(default_factory=list)
    counts: torch.Tensor | None = None
    counted_upto: list[int] = dataclasses.field(default_factory=list)
    in_flight: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
