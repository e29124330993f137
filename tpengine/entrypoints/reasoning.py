"""`--reasoning-parser`: a reasoning model's thinking, `<think>...</think>`, apart from its answer.

qwen3: the model opens its thinking itself; an output that does not start with `<think>` is all answer
(Qwen3 with thinking turned off). deepseek_r1: the chat template opened the thinking, so the output is
thinking until `</think>` (a `<think>` the model writes anyway is dropped). Streamed, a tag split over
deltas is held back until it is whole, as a stop string's start is.
"""
THINK_START, THINK_END = "<think>", "</think>"


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One completion's text, split as it streams into (reasoning, answer) deltas."""

    def __init__(self, parser: str):
        self.parser = parser
        self.state = "start"
        self.after_think_end = False  # the newlines right after </think> are not the answer's
        self.pending = ""  # text not yet told apart (a possible tag start)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) new since the last call; final: the completion ended, nothing is held back."""
        text = self.pending + delta
        self.pending = ""
        reasoning = answer = ""
        while text:
            if self.state == "start":  # does it open with <think>? (qwen3: thinking only if so)
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    text, self.state = stripped[len(THINK_START):], "thinking"
                elif THINK_START.startswith(stripped) and not final:
                    self.pending = text  # too short to tell yet
                    return reasoning, answer
                else:  # deepseek_r1: the template opened the thinking
                    self.state = "answer" if self.parser == "qwen3" else "thinking"
            elif self.state == "thinking":
                end = text.find(THINK_END)
                if end != -1:
                    reasoning += text[:end]
                    text, self.state, self.after_think_end = text[end + len(THINK_END):], "answer", True
                    continue
                keep = 0 if final else _held_back(text, THINK_END)
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


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole completion."""
    reasoning, answer = ReasoningSplitter(parser).feed(text, final=True)
    if parser == "qwen3" and not reasoning and not text.lstrip().startswith(THINK_START):
        return None, answer
    return reasoning, answer
