"""Passwords never leave in a URL or an error message, in any URL form; unusable URLs are named."""
from __future__ import annotations

import pytest

from packrat_mq.connection import RedisURLError, check_url, redact, scrub, url_secrets


@pytest.mark.parametrize(("url", "shown"), [
    # user:password@ in every scheme
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://app:pw@host:6379/0", "redis://app:***@host:6379/0"),
    ("redis://user:pw@h", "redis://user:***@h"),
    ("rediss://:pw@host:6380", "rediss://:***@host:6380"),
    ("rediss://app:pw@host:6380/2?ssl_cert_reqs=none", "rediss://app:***@host:6380/2?ssl_cert_reqs=none"),
    ("unix://:pw@/tmp/r.sock", "unix://:***@/tmp/r.sock"),
    ("unix://app:pw@/tmp/r.sock?db=2", "unix://app:***@/tmp/r.sock?db=2"),
    ("redis://u:pw@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
    ("REDIS://u:pw@h/0", "REDIS://u:***@h/0"),
    # password= (and other secret options) anywhere in the query
    ("unix:///tmp/r.sock?password=pw", "unix:///tmp/r.sock?password=***"),
    ("unix://app@/tmp/r.sock?password=pw&db=1", "unix://app@/tmp/r.sock?password=***&db=1"),
    ("redis://h/0?db=1&password=pw", "redis://h/0?db=1&password=***"),
    ("redis://h/0?db=1&password=pw&client_name=x", "redis://h/0?db=1&password=***&client_name=x"),
    ("redis://h/0?db=1;password=pw", "redis://h/0?db=1;password=***"),
    ("rediss://h?ssl_password=pw", "rediss://h?ssl_password=***"),
    ("redis://h?pass%77ord=pw", "redis://h?pass%77ord=***"),
    ("redis://h?password=", "redis://h?password=***"),
    # unencoded '&', '#', '@' inside a query password
    ("redis://h?password=a&b&db=1", "redis://h?password=***&db=1"),
    ("redis://h?password=a#b", "redis://h?password=***"),
    ("unix:///tmp/r.sock?password=a@b", "unix:///tmp/r.sock?password=***"),
    ("redis://h/0?password=a@b", "redis://h/0?password=***"),
    # unencoded '/', '@', ':', '#', '?' inside a userinfo password: the last '@' before the host wins
    ("redis://user:a/b@c@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://:s3cret/pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("redis://:p@ss@host/0", "redis://:***@host/0"),
    ("redis://:a:b@host", "redis://:***@host"),
    ("redis://:a#b@host/0", "redis://:***@host/0"),
    ("redis://:a?b@host/0", "redis://:***@host/0"),
    ("redis://:12?w=x@host/0", "redis://:***@host/0"),
    ("unix://:p/w@/tmp/r.sock", "unix://:***@/tmp/r.sock"),
    ("unix://:pw@/tmp/a@b.sock", "unix://:***@/tmp/a@b.sock"),
    ("unix://:pw@localhost", "unix://:***@localhost"),
    # percent-encoded passwords are hidden whole
    ("redis://:pa%2Fss@h:6379/0", "redis://:***@h:6379/0"),
    # the same rules for URLs that are wrong in other ways
    ("http://u:pw@host", "http://u:***@host"),
    ("u:pw@host:6379", "u:***@host:6379"),
    ("redis://u:pw@host:notaport/0", "redis://u:***@host:notaport/0"),
    # nothing to hide
    ("redis://host:6379", "redis://host:6379"),
    ("redis://app@host:6379/0", "redis://app@host:6379/0"),
    ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
    ("unix:///tmp/a@b.sock", "unix:///tmp/a@b.sock"),
    ("redis://127.0.0.1:notaport/0", "redis://127.0.0.1:notaport/0"),
    ("", ""),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_ambiguous_urls_hide_too_much_rather_than_too_little() -> None:
    # An '@' in a query value could be the end of a password holding '/' and '?':
    # the whole stretch is hidden (the host shown is then the wrong one).
    assert redact("redis://:pw@host/0?client_name=a@b") == "redis://:***@b"
    assert "pw" not in redact("redis://:pw@host/0?client_name=a@b")


@pytest.mark.parametrize(("url", "password"), [
    ("redis://:s3cret/pw@127.0.0.1:6379/0", "s3cret/pw"),
    ("redis://user:a/b@c-long@host:6379/0", "a/b@c-long"),
    ("unix:///tmp/r.sock?password=hunter2", "hunter2"),
    ("redis://:pa%2Fss-word@h/0", "pa/ss-word"),
])
def test_scrub_hides_the_url_and_the_password_in_messages(url: str, password: str) -> None:
    message = f"failed for {url}: got {password!r} and {password}"
    out = scrub(message, url)
    assert password not in out and url not in out
    assert redact(url) in out
    assert password in url_secrets(url)


def test_scrub_hides_pieces_of_a_password_urllib_split_apart() -> None:
    # urllib reads "redis://:hunter2/rest@host" as host "", port "hunter2": error
    # messages from that reading show pieces of the password.
    url = "redis://:hunter2/rest-of-it@host:6379/0"
    assert scrub("Port could not be cast to integer value as 'hunter2'", url) == \
        "Port could not be cast to integer value as '***'"
    assert scrub("nothing to hide", None) == "nothing to hide"


@pytest.mark.parametrize("url", [
    "redis://h:6379/0",
    "redis://:pw@h:6379/0",
    "redis://user:p@ss@h:6379/0",        # '@' alone is fine: urllib takes the last one
    "redis://:pa%2Fss@h:6379/0",
    "rediss://h:6380?ssl_cert_reqs=none",
    "unix:///tmp/r.sock?password=pw&db=1",
    "unix:///tmp/a@b.sock",
    "redis://h:6379/0?client_name=a@b",  # ambiguous, but urllib's reading is sound
    "redis:///0",                         # no host: localhost
])
def test_usable_urls_pass(url: str) -> None:
    check_url(url)


@pytest.mark.parametrize(("url", "reason"), [
    ("http://u:pw@host:6379", "scheme 'http'"),
    ("localhost:6379", "no scheme"),
    ("u:pw@host:6379", "no scheme"),
    ("redis://127.0.0.1:notaport/0", "port is not a number"),
    ("redis://127.0.0.1:99999/0", "out of range"),
    ("redis://h?db=x", "Invalid value for 'db'"),
    ("redis://h:6379?nonsense=1", "unknown option 'nonsense'"),
    ("redis://h?ssl_password=pw", "unknown option 'ssl_password'"),  # TLS options need rediss://
    ("redis://user:a/b@c@host:6379/0", "percent-encoded"),
    ("redis://:s3cret/pw@127.0.0.1:6379/0", "percent-encoded"),
    ("redis://user:12/cd@host/0", "percent-encoded"),  # urllib would connect to host "user", port 12
    ("redis://:a#b@host/0", "percent-encoded"),
    ("redis://:a?b@host/0", "percent-encoded"),
    ("unix://:p/w@/tmp/r.sock", "percent-encoded"),
])
def test_unusable_urls_are_named_redacted(url: str, reason: str) -> None:
    with pytest.raises(RedisURLError, match=reason) as info:
        check_url(url)
    message = str(info.value)
    assert message.startswith(f"invalid Redis URL {redact(url)}: ")
    assert "pw" not in message.replace(redact(url), "")
    for secret in url_secrets(url):
        assert secret not in message
    assert isinstance(info.value, ValueError)
