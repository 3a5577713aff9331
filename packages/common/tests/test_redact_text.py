"""redact_text: free text (an exception's repr, a parser's message) loses every
credential it quotes, and keeps the rest for the reader."""

from __future__ import annotations

import base64

from hypothesis import given
from hypothesis import strategies as st

from agentic_common import redact_text, redact_uri

# what a password in a URL's userinfo or a header value can hold, as it is quoted
# (the characters that end a userinfo or a quoted value excluded)
secrets = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="@/'\"<>,)\\"),
    min_size=4,
    max_size=30,
).map(lambda s: "Zq9" + s)  # a mark found nowhere else in the texts


@given(user=st.from_regex(r"[a-z]{1,8}", fullmatch=True), password=secrets)
def test_a_urls_password_is_masked_wherever_the_url_is_quoted(user: str, password: str) -> None:
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    text = (
        "ClientResponseError(RequestInfo("
        f"url=URL('http://{user}:{password}@10.0.0.1:8000/health'), "
        f"method='GET', headers=<CIMultiDictProxy('Host': '10.0.0.1:8000', "
        f"'Authorization': 'Basic {basic}')>), status=400, message='Invalid status line')"
    )
    shown = redact_text(text)
    assert password not in shown.replace(f"{user}:***@", "")
    assert basic not in shown
    assert f"http://{user}:***@10.0.0.1:8000/health" in shown  # the reader still sees where
    assert "status=400" in shown


HEADERS = ["Authorization", "authorization", "Cookie", "X-Api-Key"]


@given(value=secrets, name=st.sampled_from(HEADERS))
def test_a_credential_headers_value_is_masked(value: str, name: str) -> None:
    for text in (f"{name}: Bearer {value}\r\n", f"'{name}': 'Bearer {value}'", f"{name}={value}"):
        assert value not in redact_text(text).replace(name, "")


def test_text_without_credentials_is_unchanged() -> None:
    for text in (
        "connection lost: ConnectionResetError(104, 'Connection reset by peer')",
        "GET http://10.0.0.1:8000/health failed: 503",
        "user@example.com wrote http://h:1/a@b",
    ):
        assert redact_text(text) == text
    assert redact_text("http://token@h:1/x") == "http://***@h:1/x"


# a password as an operator types it into a URI, unencoded: `/`, `?`, `#` and `@`
# included (they end urlsplit's netloc early, or split it at the wrong `@`)
raw_passwords = st.text(
    st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="'\"<>\\"),
    min_size=4,
    max_size=30,
).map(lambda s: "Zq9" + s)


@given(password=raw_passwords, scheme=st.sampled_from(["redis", "rediss", "http"]))
def test_an_unencoded_password_is_masked_in_the_uri_and_in_text_quoting_it(
    password: str, scheme: str
) -> None:
    """The engine plugins logged `redis://:pa#ss@host` whole: redact_uri masked
    nothing once a `#` ended urlsplit's netloc before the `@`."""
    uri = f"{scheme}://:{password}@10.0.0.5:6379/0"
    shown = redact_uri(uri)
    assert password not in shown
    assert shown.startswith(f"{scheme}://:***@")
    assert password not in redact_text(f"ValueError('redis URI needs a host: {uri!r}')")
