"""transformers' side of the vision input tests (run under ELLM_REF_PYTHON, with Pillow
on PYTHONPATH): the image processors' pixel values and the processors' expanded prompt ids.

    python vision_ref.py pixels JOB.json OUT.npz
        JOB: {"cases": [{"name", "path", "family": "idefics3"|"gemma3", "kwargs": {...}}]}
        OUT: <name>/pixel_values (n_tiles, 3, S, S) f32, <name>/rows_cols (2,) int
    python vision_ref.py processors OUT_DIR SMOLLM2_FOLDER GEMMA3_FOLDER
        saves an Idefics3 processor (SmolLM2's tokenizer with the image tokens added) to
        OUT_DIR/idefics3 and a Gemma 3 one to OUT_DIR/gemma3, each with a config.json
    python vision_ref.py expand JOB.json OUT.json
        JOB: {"cases": [{"name", "folder", "family", "text" | "messages", "images": [paths]}]}
        OUT: {name: input_ids}
    python vision_ref.py generate JOB.json OUT.json
        JOB: {"folder", "family", "chat_template", "max_new_tokens",
              "cases": [{"name", "text" | "messages", "images": [paths]}]}
        the tiny models of tests/goldens/tiny_vision_models.py, run by transformers on what its
        processor makes of the images: OUT {name: {"ids", "greedy", "top_ids", "top_logprobs"}}

Images are opened with Pillow and turned upright with ImageOps.exif_transpose, as
transformers' load_image does; the image processor converts them to RGB itself.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def _open(path: str) -> Image.Image:
    img = Image.open(path)
    img.seek(0)
    return ImageOps.exif_transpose(img)


def _image_processor(family: str, kwargs: dict):
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        return Idefics3ImageProcessorPil(**kwargs)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    return Gemma3ImageProcessorPil(**kwargs)


def pixels(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out = {}
    for case in job["cases"]:
        proc = _image_processor(case["family"], case["kwargs"])
        img = _open(case["path"])
        if case["family"] == "idefics3":
            enc = proc(images=[[img]], return_row_col_info=True, do_pad=True)
            pv = np.asarray(enc["pixel_values"][0], dtype=np.float32)
            rc = [enc["rows"][0][0], enc["cols"][0][0]]
        else:
            enc = proc(images=[img], do_pan_and_scan=False)
            pv = np.asarray(enc["pixel_values"], dtype=np.float32)
            rc = [0, 0]
        out[f"{case['name']}/pixel_values"] = pv
        out[f"{case['name']}/rows_cols"] = np.asarray(rc, dtype=np.int64)
    np.savez(out_path, **out)


# Small templates of our own: each writes the processor's placeholder for an image part.
IDEFICS3_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %} {{ part['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def processors(out_dir: str, smollm2: str, gemma3: str) -> None:
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3Processor, Idefics3Config,
                              Idefics3Processor)
    from transformers.tokenization_utils_base import AddedToken
    out = Path(out_dir)

    # Idefics3: the image tokens real SmolVLM tokenizers carry, as special added tokens
    tok = AutoTokenizer.from_pretrained(smollm2)
    extra = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    extra += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                         for t in extra]})
    ip = _image_processor("idefics3", {"size": {"longest_edge": 2 * 364}, "max_image_size": {"longest_edge": 364}})
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=9, chat_template=IDEFICS3_TEMPLATE)
    proc.save_pretrained(out / "idefics3")
    cfg = Idefics3Config(vision_config={"image_size": 364, "patch_size": 14}, scale_factor=2,
                         text_config={"model_type": "llama", "vocab_size": len(tok)})
    cfg.image_token_id = tok.convert_tokens_to_ids("<image>")
    cfg.to_json_file(out / "idefics3" / "config.json")

    # Gemma 3: the 270m tokenizer has <start_of_image> / <end_of_image>; the soft token is added
    gtok = AutoTokenizer.from_pretrained(
        gemma3, extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"})
    gtok.add_special_tokens({"additional_special_tokens": [AddedToken("<image_soft_token>", normalized=False,
                                                                      special=True)]})
    gip = _image_processor("gemma3", {"size": {"height": 896, "width": 896}})
    gproc = Gemma3Processor(image_processor=gip, tokenizer=gtok, image_seq_length=256,
                            chat_template=GEMMA3_TEMPLATE)
    gproc.save_pretrained(out / "gemma3")
    gcfg = Gemma3Config(vision_config={"image_size": 896, "patch_size": 14}, mm_tokens_per_image=256,
                        text_config={"vocab_size": len(gtok)})
    gcfg.image_token_id = gtok.convert_tokens_to_ids("<image_soft_token>")
    gcfg.to_json_file(out / "gemma3" / "config.json")


def expand(job_path: str, out_path: str) -> None:
    from transformers import AutoProcessor
    job = json.loads(Path(job_path).read_text())
    out = {}
    procs: dict[str, object] = {}
    for case in job["cases"]:
        if case["folder"] not in procs:   # loading a 262k-token tokenizer takes seconds
            procs[case["folder"]] = AutoProcessor.from_pretrained(case["folder"])
        proc = procs[case["folder"]]
        images = [_open(p) for p in case["images"]]
        if "messages" in case:
            text = proc.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=False)
            enc = proc(text=[text], images=[images] if images else None, add_special_tokens=False)
        else:
            enc = proc(text=[case["text"]], images=[images] if images else None)
        out[case["name"]] = [int(i) for i in enc["input_ids"][0]]
    Path(out_path).write_text(json.dumps(out))


def _tiny_processor(folder: str, family: str, chat_template: str | None):
    from transformers import AutoTokenizer, Gemma3Processor, Idefics3Processor
    kwargs = json.loads((Path(folder) / "preprocessor_config.json").read_text())
    kwargs = {k: v for k, v in kwargs.items() if k not in ("image_processor_type", "image_seq_length")}
    ip = _image_processor("idefics3" if family == "smolvlm" else "gemma3", kwargs)
    if family == "smolvlm":
        # SmolVLMProcessor needs torchvision for its video half; Idefics3Processor expands
        # images with the same strings (transformers' SmolVLM and Idefics3 processors).
        return Idefics3Processor(image_processor=ip, tokenizer=AutoTokenizer.from_pretrained(folder),
                                 image_seq_len=4, chat_template=chat_template)
    tok = AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    return Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=4, chat_template=chat_template)


def generate(job_path: str, out_path: str) -> None:
    import torch
    import transformers as tf
    job = json.loads(Path(job_path).read_text())
    family = job["family"]
    proc = _tiny_processor(job["folder"], family, job.get("chat_template"))
    cls = tf.SmolVLMForConditionalGeneration if family == "smolvlm" else tf.Gemma3ForConditionalGeneration
    model = cls.from_pretrained(job["folder"], dtype=torch.float32, attn_implementation="eager").eval()
    out = {}
    for case in job["cases"]:
        images = [_open(p) for p in case["images"]]
        if "messages" in case:
            text = proc.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=False)
            enc = proc(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")
        else:
            enc = proc(text=[case["text"]], images=[images], return_tensors="pt")
        # ellm (like the goldens of tiny_vision_models.py) attends causally over image
        # tokens; Gemma 3's token_type_ids would make them attend both ways
        enc.pop("token_type_ids", None)
        enc.pop("mm_token_type_ids", None)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=job["max_new_tokens"], do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        first = torch.log_softmax(gen.scores[0][0].float(), -1)
        top = torch.topk(first, 5)
        n = enc["input_ids"].shape[1]
        out[case["name"]] = {"ids": enc["input_ids"][0].tolist(), "greedy": gen.sequences[0, n:].tolist(),
                             "top_ids": top.indices.tolist(), "top_logprobs": top.values.tolist()}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    {"pixels": pixels, "processors": processors, "expand": expand,
     "generate": generate}[sys.argv[1]](*sys.argv[2:])
