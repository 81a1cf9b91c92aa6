"""A media prompt, fed into one session piece by piece.

The projector (``engine.media.Projector``) splits a prompt at its marker into
text runs and media items. ``MediaFeed`` hands them to a job's ``plan`` in
order, as ordinary ``Step``s of ``RuntimeState.forward`` (so positions,
their check against the engine, sampling with the request's spec and
hidden-state capture are the ordinary ones):

- a text run goes as prefill steps of at most ``chunk`` tokens a turn,
  sharing forwards with other sessions' work;
- a media item is encoded by the projector (its vision tower) and its rows
  decoded as input embeddings (``Step.embd``), with non-causal attention
  when the projector says so (``Step.non_causal``). Such a step must be the
  only work of its forward (``wants_exclusive``; see ``media_jobs``).

Media positions have no token id: the step's tokens, and so the session's
history, hold ``MEDIA_TOKEN`` (-1) for each, as for embeddings input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from faults import BadRequest, Internal

from ..engine.media import Projector
from ..engine.media_native import Bitmap, Chunks, ProjectorError
from ..engine.media_sniff import MediaError
from ..runtime import Session, Step, StepResult
from ..spec import SamplerSpec

MEDIA_TOKEN = -1  # a session-history entry for a position without a token id


@dataclass
class MediaPrompt:
    """A prompt as the edge validated it: text with one marker per item, and
    the items decoded (owned bitmaps, freed once tokenized or with the job)."""

    projector: Projector
    text: str
    bitmaps: list[Bitmap]
    add_special: bool | None = None  # None: BOS when the session is empty
    parse_special: bool = False

    def tokenize(self, fresh: bool) -> Chunks:
        """The prompt's chunks; mtmd copies each image, so the bitmaps go."""
        add = fresh if self.add_special is None else self.add_special
        try:
            return self.projector.tokenize(self.text, self.bitmaps, add, self.parse_special)
        except MediaError as exc:
            raise BadRequest(f"media: {exc}") from None
        finally:
            self.close()

    def close(self) -> None:
        for bitmap in self.bitmaps:
            bitmap.close()
        self.bitmaps = []


@dataclass
class Piece:
    """A text run (token ids) or one media item (``MEDIA_TOKEN`` per position)."""

    tokens: list[int]
    media: int | None = None  # the item's chunk index
    non_causal: bool = False


@dataclass
class MediaFeed:
    """The pieces of one media prompt and how far they have been fed."""

    projector: Projector
    chunks: Chunks
    chunk: int  # text tokens per step
    pieces: list[Piece] = field(default_factory=list)
    at: int = 0  # current piece
    offset: int = 0  # tokens of it already fed
    inflight: int = 0
    captured: list[StepResult] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        projector: Projector,
        chunks: Chunks,
        chunk: int,
        n_ubatch: int,
        prefix: Sequence[int] = (),
        drop_bos: int | None = None,
    ) -> MediaFeed:
        """Pieces from ``chunks`` with ``prefix`` ids first (a pending token,
        a chat's closer); ``drop_bos`` drops that leading token of the prompt
        (a chat turn on a session that has one). Refuses a non-causal item
        wider than a micro-batch (llama.cpp would abort)."""
        feed = cls(projector, chunks, max(1, chunk))
        pieces: list[Piece] = []
        for i, part in enumerate(chunks.parts):
            if part.kind == "text":
                pieces.append(Piece(list(part.tokens or ())))
                continue
            non_causal = projector.non_causal_chunk(chunks, i)
            if non_causal and part.n_tokens > n_ubatch:
                raise BadRequest(
                    f"a media item of {part.n_tokens} tokens does not fit one micro-batch "
                    f"({n_ubatch}); the worker needs --ubatch >= {part.n_tokens}"
                )
            pieces.append(Piece([MEDIA_TOKEN] * part.n_tokens, i, non_causal))
        first = pieces[0] if pieces else None
        if (
            drop_bos is not None
            and first
            and first.media is None
            and first.tokens[:1] == [drop_bos]
        ):
            del first.tokens[0]
        if prefix:
            if pieces and pieces[0].media is None:
                pieces[0].tokens[:0] = prefix
            else:
                pieces.insert(0, Piece(list(prefix)))
        feed.pieces = [p for p in pieces if p.tokens]
        return feed

    @property
    def tokens(self) -> list[int]:
        """Every position's entry in the session history."""
        return [t for p in self.pieces for t in p.tokens]

    @property
    def total(self) -> int:
        return sum(len(p.tokens) for p in self.pieces)

    @property
    def media_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.pieces if p.media is not None)

    @property
    def done(self) -> bool:
        return self.at >= len(self.pieces)

    def wants_exclusive(self) -> bool:
        return not self.done and self.pieces[self.at].media is not None

    def plan(
        self,
        session: Session,
        budget: int,
        spec: SamplerSpec | None,
        outputs: tuple[str, ...] = (),
        capture_all: bool = False,
        top_logprobs: int | None = None,
    ) -> list[Step]:
        """The next step: a text piece within ``budget``, or a media item
        (in its exclusive turn; the budget does not apply). The last step
        samples the next token with ``spec``. ``outputs`` are captured for
        every row (``capture_all``) or only for the sampled one."""
        piece = self.pieces[self.at]
        last_piece = self.at == len(self.pieces) - 1
        if piece.media is not None:
            try:
                embd = self.projector.encode(self.chunks, piece.media)
            except ProjectorError as exc:
                raise Internal(f"media: {exc}") from None
            if embd.shape != (len(piece.tokens), self.projector.engine.n_embd):
                raise Internal(f"media embeddings of shape {embd.shape} do not fit the model")
            n, last = len(piece.tokens), last_piece
        else:
            left = len(piece.tokens) - self.offset
            n = min(left, self.chunk, budget)
            if n <= 0:
                return []
            embd, last = None, last_piece and n == left
        self.inflight = n
        return [
            Step(
                session,
                piece.tokens[self.offset : self.offset + n],
                sample=last,
                spec=spec,
                outputs=outputs if capture_all or last else (),
                top_logprobs=top_logprobs if last else None,
                capture_all=capture_all,
                embd=embd,
                non_causal=piece.non_causal and embd is not None,
            )
        ]

    def advance(self, results: list[StepResult], capture: bool = False) -> StepResult:
        """Account for the step ``plan`` gave; its result."""
        if capture:
            self.captured.append(results[0])
        self.offset += self.inflight
        self.inflight = 0
        if self.offset >= len(self.pieces[self.at].tokens):
            self.at += 1
            self.offset = 0
        return results[0]

    def close(self) -> None:
        self.chunks.close()


def feed_for(
    prompt: MediaPrompt,
    chunks: Chunks,
    chunk: int,
    n_ubatch: int,
    prefix: Sequence[int],
    drop_bos: int | None = None,
) -> MediaFeed:
    """``MediaFeed.build``, freeing the chunks when it refuses them."""
    try:
        return MediaFeed.build(prompt.projector, chunks, chunk, n_ubatch, prefix, drop_bos)
    except BaseException:
        chunks.close()
        raise
