"""This process's place in the tensor-parallel group; tp size 1 needs no torch.distributed at all."""
import socket

import torch
import torch.distributed as dist


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now; picked at run time so engines on one host coexist."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator
