"""Child process of a sanitized launch (see sanitize.py). Runs as a script
with libasan preloaded; imports nothing from fagen.

argv[1] is a directory holding job.json and the input .npy files; the child
writes the output .npy files and result.json there.
"""
import ctypes
import json
import os
import sys

import numpy as np

_SCALARS = {"i": ctypes.c_int, "I": ctypes.c_uint, "q": ctypes.c_longlong, "Q": ctypes.c_ulonglong,
            "f": ctypes.c_float, "d": ctypes.c_double, "?": ctypes.c_bool}
_ERRLEN = 8192


def main(folder: str) -> None:
    with open(os.path.join(folder, "job.json")) as f:
        job = json.load(f)
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    lib = ctypes.CDLL(job["so"], mode=ctypes.RTLD_LOCAL)
    fn = getattr(lib, "fagen_launch_" + job["kernel"])
    fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
                                         ctypes.c_size_t]
    fn.restype = ctypes.c_int
    holders, buffers, addrs, mallocs = [], [], [], {}
    for index, a in enumerate(job["args"]):
        if a["code"] == "M":  # filled in below, once the buffer it points into exists
            holders.append(None)
            addrs.append(0)
            continue
        if a["code"] != "P":
            holders.append(_SCALARS[a["code"]](a["value"]))
        elif a["file"] is None:
            holders.append(ctypes.c_void_p(0))
        else:
            arr = np.load(os.path.join(folder, a["file"]), allow_pickle=False)
            ptr = libc.malloc(arr.nbytes)  # exact size: the redzone starts right after it
            ctypes.memmove(ptr, arr.ctypes.data, arr.nbytes)
            buffers.append((ptr, arr, a["out"], index))
            mallocs[index] = ptr
            holders.append(ctypes.c_void_p(ptr))
        addrs.append(ctypes.addressof(holders[-1]))
    for index, a in enumerate(job["args"]):
        if a["code"] == "M":  # a tensor map by value (64-byte aligned), its address moved into the copy
            data = bytearray(bytes.fromhex(a["bytes"]))
            at = a["address_at"]
            data[at:at + 8] = (mallocs[a["base_arg"]] + a["offset"]).to_bytes(8, "little")
            raw = (ctypes.c_ubyte * 192)()
            addr = ctypes.addressof(raw) + (-ctypes.addressof(raw) % 64)
            ctypes.memmove(addr, bytes(data), len(data))
            holders[index] = raw
            addrs[index] = addr
    # Where each buffer lives, so the parent can name the one an ASan report hits.
    with open(os.path.join(folder, "buffers.json"), "w") as f:
        json.dump([{"arg": a, "addr": ptr, "nbytes": arr.nbytes} for ptr, arr, _, a in buffers], f)
    argv = (ctypes.c_void_p * max(1, len(addrs)))(*addrs)
    err = ctypes.create_string_buffer(_ERRLEN)
    status = fn(*job["grid"], *job["block"], job["smem"], argv, err, _ERRLEN)
    where = (ctypes.c_uint * 3)()
    lib.fagen_emu_last_block(where)
    for ptr, arr, out, _ in buffers:
        ctypes.memmove(arr.ctypes.data, ptr, arr.nbytes)
        np.save(os.path.join(folder, out), arr, allow_pickle=False)
        libc.free(ptr)
    result = {"status": status, "message": err.value.decode(errors="replace"), "block": list(where)}
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
