"""The models a request's `model` may name, as vLLM's OpenAIServingModels keeps them: the served model, and the LoRA
adapters on it (--lora-modules, and those POST /v1/load_lora_adapter adds with --allow-runtime-lora-updating)."""
import itertools
import logging
import time

import msgspec

from tpengine.entrypoints.api_error import ApiError
from tpengine.errors import InvalidRequestError
from tpengine.lora.request import LoRARequest

logger = logging.getLogger("tpengine")


class LoRAModulePath(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An adapter to serve: vLLM's --lora-modules name=path, or its JSON {"name", "path", "base_model_name"}."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """A --lora-modules value, vLLM's either form; ValueError naming what is wrong."""
    if not text.lstrip().startswith("{"):
        name, equals, path = text.partition("=")
        if not (equals and name and path):
            raise ValueError(f"must be NAME=PATH or a JSON object {{\"name\": ..., \"path\": ...}}, got {text!r}")
        return LoRAModulePath(name, path)
    try:
        module = msgspec.json.decode(text, type=LoRAModulePath)
    except msgspec.DecodeError as e:  # ValidationError among them: a missing, unknown or mistyped field
        raise ValueError(f"{e} in {text!r} (its fields: name, path, base_model_name)") from None
    if not (module.name and module.path):
        raise ValueError(f"name and path must not be empty, got {text!r}")
    return module


class ServedModels:
    """The served model's name, and each adapter's LoRARequest and model card by name. An adapter's int id is never
    given twice: the engine keys its adapter slots and cached prefixes on it, so one loaded again under the same name
    (maybe from another folder) is a new adapter to it. An unloaded adapter's running requests finish: they hold
    their LoRARequest."""

    def __init__(self, base_model_name: str, model_path: str, max_lora_rank: int | None = None):
        self.base_model_name = base_model_name
        self.model_path = model_path
        self.max_lora_rank = max_lora_rank  # None: the engine runs without LoRA (no --enable-lora)
        self.created = int(time.time())
        self._lora_requests: dict[str, LoRARequest] = {}
        self._lora_cards: dict[str, dict] = {}
        self._lora_int_ids = itertools.count(1)

    @property
    def lora_requests(self) -> list[LoRARequest]:
        return list(self._lora_requests.values())

    def add(self, module: LoRAModulePath) -> LoRARequest:
        """Serve module at once (--lora-modules: the engine checks each before the server takes requests)."""
        request = self.new_lora_request(module)
        self.register(request)
        return request

    def new_lora_request(self, module: LoRAModulePath) -> LoRARequest:
        """The LoRARequest module is to be served as, with an id of its own, its adapter_config.json and weights'
        names checked; nothing is served yet. InvalidRequestError naming the load request's field if the name is
        taken or the adapter is one the engine cannot run."""
        from tpengine.lora.adapter import read_adapter_config

        if self.max_lora_rank is None:
            raise InvalidRequestError("LoRA adapters need the server started with --enable-lora")
        self._check_name_free(module.name)
        try:
            read_adapter_config(module.path, self.max_lora_rank)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_path") from None  # it names the folder and what is wrong
        if module.base_model_name not in (None, self.base_model_name):  # vLLM's rule: the parent is a served model
            logger.warning("LoRA adapter %r: base_model_name %r is not the served model %r, its parent here",
                           module.name, module.base_model_name, self.base_model_name)
        return LoRARequest(module.name, next(self._lora_int_ids), module.path)

    def register(self, request: LoRARequest) -> None:
        """Serve what new_lora_request made; InvalidRequestError if another load took its name meanwhile."""
        self._check_name_free(request.lora_name)
        self._lora_requests[request.lora_name] = request
        self._lora_cards[request.lora_name] = {
            "id": request.lora_name, "object": "model", "created": int(time.time()), "owned_by": "tpengine",
            "root": request.lora_path, "parent": self.base_model_name}
        logger.info("serving LoRA adapter %r from %s", request.lora_name, request.lora_path)

    def _check_name_free(self, name: str) -> None:
        if name == self.base_model_name:
            raise InvalidRequestError(f"{name!r} is the served model's name: an adapter needs a name of its own",
                                      "lora_name")
        if name in self._lora_requests:
            raise InvalidRequestError(f"the LoRA adapter {name!r} has already been loaded", "lora_name")

    def remove(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving an adapter; its LoRARequest (a 404 if there is none by that name, or with that id)."""
        request = self._lora_requests.get(name)
        if request is None or lora_int_id not in (None, request.lora_int_id):
            with_id = "" if lora_int_id is None else f" with lora_int_id {lora_int_id}"
            raise ApiError(404, f"the LoRA adapter {name!r}{with_id} cannot be found", "not_found_error",
                           "lora_name", "model_not_found")
        del self._lora_requests[name], self._lora_cards[name]
        logger.info("unloaded LoRA adapter %r", name)
        return request

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the served model itself); a 404 for a name not served."""
        if name is None or name == self.base_model_name:
            return None
        request = self._lora_requests.get(name)
        if request is None:
            served = repr(self.base_model_name) if not self._lora_requests else \
                f"{self.base_model_name!r} and {len(self._lora_requests)} LoRA adapters (GET /v1/models lists them)"
            raise ApiError(404, f"model {name!r} does not exist; this server serves {served}", "not_found_error",
                           "model", "model_not_found")
        return request

    def cards(self, max_model_len: int) -> list[dict]:
        """GET /v1/models: the served model's card, then each adapter's."""
        base = {"id": self.base_model_name, "object": "model", "created": self.created, "owned_by": "tpengine",
                "root": self.model_path, "parent": None}
        return [{**card, "max_model_len": max_model_len} for card in (base, *self._lora_cards.values())]

    def card(self, name: str, max_model_len: int) -> dict:
        """GET /v1/models/{name}: the card of a served name (a 404 for another)."""
        self.lora_request(name)
        return next(card for card in self.cards(max_model_len) if card["id"] == name)
