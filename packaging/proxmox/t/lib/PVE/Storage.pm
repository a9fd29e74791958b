package PVE::Storage;

# Stand-in for Proxmox's PVE::Storage (pve-storage), for the plugin's tests only: the
# storage API version a Proxmox VE 9 host announces, and the parts of vdisk_free and
# vdisk_list that decide what an admin sees — a template that a linked clone names as
# its base is not deleted. Written from pve-storage's documented behaviour, not copied.

use strict;
use warnings;

use PVE::Storage::Plugin;

# pve-storage's current storage API (its ApiChangeLog): version 15, compatible with
# the 6 before it.
use constant APIVER => 15;
use constant APIAGE => 6;

# "STORE:VOLNAME" -> (STORE, VOLNAME).
sub parse_volume_id {
    my ($volid) = @_;
    return ($1, $2) if $volid =~ m/^([a-z][a-z0-9\-_.]*[a-z0-9]):(.+)$/i;
    die "unable to parse volume ID '$volid'\n";
}

# Whether $volid is a template (base) volume that another volume on its storage names
# as its base, as Proxmox checks before freeing one.
sub volume_is_base_and_used {
    my ($plugin, $storeid, $scfg, $volid) = @_;
    my (undef, $volname) = parse_volume_id($volid);
    my (undef, $name, $vmid, undef, undef, $is_base) = $plugin->parse_volname($volname);
    return 0 if !$is_base;
    for my $info ($plugin->list_images($storeid, $scfg)->@*) {
        my (undef, $other) = parse_volume_id($info->{volid});
        my (undef, undef, undef, $basename, $basevmid) = eval { $plugin->parse_volname($other) };
        return 1 if $basename && defined($basevmid) && $basevmid == $vmid && $basename eq $name;
    }
    return 0;
}

# Free a volume as `qm destroy`, the GUI's "Remove" or `pvesm free` do.
sub vdisk_free {
    my ($plugin, $storeid, $scfg, $volid) = @_;
    my (undef, $volname) = parse_volume_id($volid);
    $plugin->activate_storage($storeid, $scfg, {});
    die "base volume '$volname' is still in use by linked clones\n"
        if volume_is_base_and_used($plugin, $storeid, $scfg, $volid);
    my (undef, undef, undef, undef, undef, $is_base, $format) = $plugin->parse_volname($volname);
    return $plugin->free_image($storeid, $scfg, $volname, $is_base, $format);
}

1;
