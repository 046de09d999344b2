"""The one reader of TensorBoard events that the tools and the tests share (not collected by
pytest): a run folder's scalars as TensorBoard shows them or as written, each events file's
records checked, and a run's settings from its logged hyperparameters and its checkpoint."""
import glob
import logging
import os
import re
import struct

logging.getLogger("tensorboard").setLevel(logging.ERROR)  # no word per purged resume


class Bad(Exception):
    """Bad input: the tools print it in one line and exit 2."""


def events_files(run_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))


def check_events(path: str):
    """Every record of a TensorBoard events file whole and its checksums right: TensorBoard
    stops reading a file at a bad record without a word. An unfinished last record (a writer
    killed mid-write) is allowed, as TensorBoard allows it."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    with open(path, "rb") as f:
        data = f.read()
    position, record = 0, 1
    while len(data) - position >= 12:
        header = data[position:position + 8]
        (length,), (check,) = struct.unpack("<Q", header), struct.unpack(
            "<I", data[position + 8:position + 12])
        end = position + 12 + length + 4
        whole = end <= len(data)
        if masked_crc32c(header) != check or (whole and masked_crc32c(
                data[position + 12:end - 4]) != struct.unpack("<I", data[end - 4:end])[0]):
            raise Bad(f"{path}: corrupt events file: record {record} (byte {position:,}) fails "
                      f"its checksum; TensorBoard stops reading there: move the file aside to "
                      f"compare what the run's other files hold")
        if not whole:
            break
        position, record = end, record + 1


def scalars(run_dir: str, raw=False, checked=False) -> dict:
    """{tag: [(step, value), ...]} from the run folder's events files. raw=True reads every
    event as written (so a step logged twice shows twice); otherwise TensorBoard's own view
    (events a resume purged left out). checked=True refuses a folder with no events files and
    checks each file's records first."""
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.util import tensor_util

    files = events_files(run_dir)
    if checked:
        if not files:
            raise Bad(f"{run_dir} holds no TensorBoard events: not a run folder of ppo_atari.py")
        for file in files:
            check_events(file)
    if not raw:
        acc = event_accumulator.EventAccumulator(run_dir, size_guidance={"scalars": 0})
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    out = {}
    for path in files:
        for event in event_file_loader.EventFileLoader(path).Load():
            for v in event.summary.value:
                if v.metadata.plugin_data.plugin_name == "scalars":
                    value = float(tensor_util.make_ndarray(v.tensor).item())
                    out.setdefault(v.tag, []).append((event.step, value))
    return out


def run_settings(path: str) -> dict:
    """A run folder's Args as text: its logged hyperparameters, overridden by its checkpoint's;
    "from" says which held the env id."""
    from tensorboard.backend.event_processing import event_accumulator
    acc = event_accumulator.EventAccumulator(path, size_guidance={"tensors": 0})
    acc.Reload()
    settings = {}
    if "hyperparameters/text_summary" in acc.Tags()["tensors"]:
        text = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0]
        settings = dict(re.findall(r"^\|([^|]+)\|([^|]*)\|$", text.decode(), re.M))
    source = "logged hyperparameters" if settings.get("env_id") else None
    checkpoint = os.path.join(path, "checkpoint.pt")
    if os.path.isfile(checkpoint):
        import torch
        try:
            saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
            saved_args = dict(saved["args"])
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise Bad(f"{checkpoint}: cannot be read as a checkpoint of ppo_atari.py ({first}); "
                      f"move it aside to compare the run by its events alone")
        settings.update({k: str(v) for k, v in saved_args.items()})
        source = "checkpoint" if saved_args.get("env_id") else source
    return {**settings, "from": source}
