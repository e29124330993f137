"""Images through /v1/chat/completions with the openai client: image_url parts as data: URLs and file:// paths under
--allowed-local-media-path give transformers' greedy tokens; a network URL, a path outside the folder, a malformed
image and too many images are 400s naming the image, and the server keeps serving."""
import base64
import io

import openai
import pytest

from tests.entrypoints.conftest import running_server
from tests.models.vision import hf_image_greedy, qwen2_5_vl_checkpoint, random_image

GREEDY = dict(model="tiny", temperature=0.0, max_completion_tokens=6,
              extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    random_image(21, 120, 90).save(folder / "photo.png")
    return folder


@pytest.fixture(scope="module")
def vl_server(media):
    yield from running_server(qwen2_5_vl_checkpoint(), "--allowed-local-media-path", str(media),
                              "--limit-mm-per-prompt", '{"image": 2}')


@pytest.fixture
def vl_client(vl_server):
    with openai.OpenAI(base_url=f"{vl_server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_images_gives_transformers_tokens(vl_client, media):
    from PIL import Image
    picture = random_image(20, 90, 60)
    content = [{"type": "text", "text": "Compare "}, image_part(data_url(picture)), {"type": "text", "text": " and "},
               image_part(f"file://{media}/photo.png")]
    choice = vl_client.chat.completions.create(messages=[{"role": "user", "content": content}], **GREEDY).choices[0]
    # the prompt as the template renders it, each image's placeholder grown to its tokens
    photo = Image.open(media / "photo.png")
    rendered = _unexpanded(choice.prompt_token_ids)
    expected = hf_image_greedy(qwen2_5_vl_checkpoint(), rendered, [picture, photo], 6)
    assert choice.token_ids == expected
    streamed = vl_client.chat.completions.create(messages=[{"role": "user", "content": content}], stream=True,
                                                 **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == \
        choice.message.content


def _unexpanded(prompt_token_ids: list[int]) -> list[int]:
    """The prompt with each run of image placeholders one token again (as the chat template wrote it)."""
    from tests.models.vision import IMAGE_TOKEN_ID
    return [t for i, t in enumerate(prompt_token_ids)
            if t != IMAGE_TOKEN_ID or i == 0 or prompt_token_ids[i - 1] != IMAGE_TOKEN_ID]


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "image 0: fetching images over the network is not enabled"),
    ("file:///etc/hostname", "is outside --allowed-local-media-path"),
    ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "image 0 could not be decoded"),
    ("data:text/plain;base64,aGk=", "a data URL must be data:image/<type>;base64,<data>"),
])
def test_a_bad_image_is_a_400_naming_it(vl_client, url, message):
    with pytest.raises(openai.BadRequestError) as error:
        vl_client.chat.completions.create(messages=[{"role": "user", "content": [image_part(url)]}], **GREEDY)
    assert message in error.value.message
    assert len(vl_client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                                 **GREEDY).choices[0].token_ids) == 6


def test_more_images_than_the_limit_is_a_400(vl_client):
    url = data_url(random_image(22, 60, 60))
    with pytest.raises(openai.BadRequestError) as error:
        vl_client.chat.completions.create(messages=[{"role": "user", "content": [image_part(url)] * 3}], **GREEDY)
    assert "3 images, more than the limit of 2 per prompt" in error.value.message


def test_a_text_model_refuses_image_parts(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(messages=[{"role": "user", "content": [image_part("data:image/png;base64,")]}],
                                       **GREEDY)
    assert "reads no images" in error.value.message


def test_a_request_s_pixel_limits_resize_its_images_and_bad_ones_are_400s(vl_client):
    from tests.models.vision import IMAGE_TOKEN_ID
    content = [image_part(data_url(random_image(23, 300, 200))), {"type": "text", "text": "Small."}]
    limits = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 6}
    choice = vl_client.chat.completions.create(
        messages=[{"role": "user", "content": content}],
        **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "mm_processor_kwargs": limits}}).choices[0]
    assert choice.prompt_token_ids.count(IMAGE_TOKEN_ID) <= 6
    with pytest.raises(openai.BadRequestError) as error:
        vl_client.chat.completions.create(
            messages=[{"role": "user", "content": content}],
            **{**GREEDY, "extra_body": {**GREEDY["extra_body"], "mm_processor_kwargs": {"num_crops": 2}}})
    assert "mm_processor_kwargs: ['num_crops'] not supported" in error.value.message


def test_anthropic_image_blocks_read_as_the_chat_s_image_url_parts(vl_server, vl_client):
    import anthropic
    picture = random_image(24, 90, 60)
    encoded = data_url(picture).split(",", 1)[1]
    text = [{"type": "text", "text": "What is it?"}]
    chat = vl_client.chat.completions.create(
        messages=[{"role": "user", "content": [image_part(data_url(picture)), *text]}], **GREEDY).choices[0]
    with anthropic.Anthropic(base_url=vl_server.url, api_key="unused", max_retries=0) as claude:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}}
        message = claude.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0},  # not in the SDK
                                         messages=[{"role": "user", "content": [image, *text]}])
        assert message.content[0].text == chat.message.content
        assert message.usage.input_tokens == len(chat.prompt_token_ids)
        with pytest.raises(anthropic.BadRequestError) as error:
            claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
        assert "fetching images over the network is not enabled" in error.value.message


def test_responses_input_image_parts_read_as_the_chat_s_image_url_parts(vl_client):
    picture = random_image(25, 90, 60)
    chat = vl_client.chat.completions.create(  # EOS may end both: the Responses API has no ignore_eos
        messages=[{"role": "user", "content": [image_part(data_url(picture)), {"type": "text", "text": "Name it."}]}],
        **{**GREEDY, "extra_body": {"return_token_ids": True}}).choices[0]
    reply = vl_client.responses.create(model="tiny", max_output_tokens=6, temperature=0.0, input=[
                                       {"role": "user", "content": [
                                           {"type": "input_image", "image_url": data_url(picture)},
                                           {"type": "input_text", "text": "Name it."}]}])
    assert reply.output_text == chat.message.content
    assert reply.usage.input_tokens == len(chat.prompt_token_ids)


def test_tokenize_counts_each_image_s_tokens_as_the_chat_runs_them(vl_server, vl_client):
    messages = [{"role": "user", "content": [image_part(data_url(random_image(26, 90, 60))),
                                             {"type": "text", "text": "Count me."}]}]
    chat = vl_client.chat.completions.create(messages=messages, **GREEDY).choices[0]
    status, tokenized = vl_server.request("POST", "/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200 and tokenized["tokens"] == chat.prompt_token_ids


def test_gemma3_chat_with_images_gives_transformers_tokens_through_the_server(media):
    """Gemma 3: each image part's <start_of_image> written out as Gemma3Processor writes it, its tokens attending to
    each other both ways; its processor takes no pixel limits (a 400 naming them)."""
    from PIL import Image
    from tests.models.vision import gemma3_checkpoint, hf_gemma3_greedy
    path, picture = gemma3_checkpoint(), random_image(22, 70, 50)
    content = [{"type": "text", "text": "Compare "}, image_part(data_url(picture)), {"type": "text", "text": " and "},
               image_part(f"file://{media}/photo.png")]
    for server in running_server(path, "--allowed-local-media-path", str(media)):
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
            choice = client.chat.completions.create(messages=[{"role": "user", "content": content}],
                                                    **GREEDY).choices[0]
            expected = hf_gemma3_greedy(path, choice.prompt_token_ids, [picture, Image.open(media / "photo.png")], 6)
            assert choice.prompt_token_ids.count(259) == 8 and choice.token_ids == expected
            with pytest.raises(openai.BadRequestError, match="pixel limits do not apply"):
                client.chat.completions.create(messages=[{"role": "user", "content": content}],
                                               **{**GREEDY, "extra_body": {"mm_processor_kwargs": {"max_pixels": 900}}})
