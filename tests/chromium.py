"""Headless Debian Chromium for the browser tests (dashboard, training in onnxruntime-web)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# What the machine's closed network needs: no background networking, component updates or sync
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1600")


def start_chromium(*extra_flags: str) -> Any:
    """A Selenium driver of headless Chromium through Debian's chromedriver (installed by `make test`);
    skips the test when they are not installed. The caller quits it."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed; `make test` installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, *extra_flags):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def trust_certificate_flag(cert_pem: bytes) -> str:
    """The flag that makes Chromium accept one TLS certificate's key (a test CA's gateway), and no other."""
    import base64
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    spki = x509.load_pem_x509_certificate(cert_pem).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "--ignore-certificate-errors-spki-list=" + base64.b64encode(hashlib.sha256(spki).digest()).decode()
