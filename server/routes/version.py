"""GET /version: the meterserve package version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

router = APIRouter()


def package_version() -> str:
    try:
        return version("meterserve")
    except PackageNotFoundError:
        return "0+unknown"


@router.get("/version")
async def get_version() -> dict:
    return {"version": package_version()}
