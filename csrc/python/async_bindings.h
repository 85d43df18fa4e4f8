// Registers asynchronous gossip in gossip_ext._C: the channels (Departures, PeerChannel, Mailbox,
// Outbox, mailbox_tag, MESSAGE_HEADER) and the engine (AsyncOptions, AsyncPushSum).
#pragma once

#include <pybind11/pybind11.h>

namespace gossip {

void bind_asynchronous(pybind11::module_& m);

}  // namespace gossip
