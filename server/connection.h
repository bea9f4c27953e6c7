// Whether a request's client is still there. cpp-httplib 0.11 (Debian 12's)
// gives a handler neither its socket nor a way to see the client leave (later
// versions have Request::is_connection_closed), so the handler finds its socket
// by the peer address httplib reports and asks the kernel.
#pragma once

#include <string>

namespace moegraph {

// The socket of this process connected to the peer addr:port (numeric, as
// httplib's Request::remote_addr and remote_port), or -1 if none is.
int FindPeerSocket(const std::string& addr, int port);

// The peer has closed its end (a FIN or a reset arrived) or fd is no longer a
// connected socket. Does not read: data the peer sent stays queued.
bool PeerHasLeft(int fd);

}  // namespace moegraph
