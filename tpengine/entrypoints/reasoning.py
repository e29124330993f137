"""`--reasoning-parser`: a reasoning model's thinking, `<think>...</think>`, apart from its answer.

qwen3 and deepseek_r1 read a reply by the one rule the engine's grammar also follows (tpengine/thinking.py): the
reply thinks first when its prompt left the thinking open (a template that opens it) or when it starts with <think>
(a model that opens its own); else all of it is answer. The thinking ends at </think>, and the newlines right after
it are not the answer's. Streamed, a tag split over deltas is held back until it is whole, as a stop string's
start is.
"""
from tpengine.thinking import THINK_END, THINK_START


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One reply's text, split as it streams into (reasoning, answer) deltas; a whole reply is one final feed."""

    def __init__(self, thinking_open: bool):
        """thinking_open: the prompt left the thinking open (thinking_open_after)."""
        # "start": the reply's first characters tell whether it opens its thinking (a <think> the model writes first
        # anyway, when the prompt opened it, is not reasoning either)
        self.state = "start"
        self.thinking = thinking_open  # whether the reply has thinking at all (else it has no reasoning_content)
        self.after_think_end = False  # the newlines right after </think> are not the answer's
        self.pending = ""  # text not yet told apart (a possible tag start)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) new since the last call; final: the reply ended, nothing is held back."""
        text = self.pending + delta
        self.pending = ""
        reasoning = answer = ""
        while text:
            if self.state == "start":
                if text.startswith(THINK_START):
                    text, self.state, self.thinking = text[len(THINK_START):], "thinking", True
                elif THINK_START.startswith(text) and not final:
                    self.pending = text  # too short to tell yet
                    return reasoning, answer
                else:
                    self.state = "thinking" if self.thinking else "answer"
            elif self.state == "thinking":
                end = text.find(THINK_END)
                if end != -1:
                    reasoning += text[:end]
                    text, self.state, self.after_think_end = text[end + len(THINK_END):], "answer", True
                    continue
                keep = 0 if final else held_back(text, THINK_END)
                reasoning += text[:len(text) - keep]
                self.pending = text[len(text) - keep:]
                return reasoning, answer
            else:
                if self.after_think_end:
                    text = text.lstrip("\n")
                    self.after_think_end = not text
                answer += text
                text = ""
        return reasoning, answer
