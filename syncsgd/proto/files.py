"""Reading protobuf files, text or binary, with errors that name the file and what is wrong."""
import os

from google.protobuf.message import DecodeError

from syncsgd.errors import PrototxtError

MAX_PROTO_BYTES = 1 << 30   # larger text or binary protos are refused before parsing


def read_binary(path, message):
    """Parse a binary proto file into `message`."""
    data = read_file(path, "rb")
    try:
        message.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise PrototxtError(f"{path}: not a binary {message.DESCRIPTOR.name} "
                            f"(truncated or corrupt?): {e}") from None
    return message


def read_file(path, mode):
    """A proto file's contents (text mode "r" or binary "rb"); errors name the file."""
    try:
        size = os.path.getsize(path)
        if size > MAX_PROTO_BYTES:
            raise PrototxtError(f"{path}: {size} bytes is larger than the {MAX_PROTO_BYTES} "
                                "bytes a protobuf may have")
        with open(path, mode) as f:
            return f.read()
    except FileNotFoundError:
        where = "" if os.path.isabs(path) else f" in {os.getcwd()}"
        raise PrototxtError(f"{path}: no such file{where}") from None
    except UnicodeDecodeError:
        raise PrototxtError(f"{path}: not a text prototxt (binary data?)") from None
    except OSError as e:
        raise PrototxtError(f"{path}: cannot read: {e.strerror}") from None
